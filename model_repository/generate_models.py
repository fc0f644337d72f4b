"""Generate the example repository's binary model files (kept out of git). Idempotent."""

from pathlib import Path

import torch

REPOSITORY = Path(__file__).resolve().parent


class Linear(torch.nn.Module):
    """y = x @ W^T + b with W[i, j] = i + j / 10 and b = [0.5, -0.5]: easy to check by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        with torch.no_grad():
            self.linear.weight.copy_(torch.tensor([[j / 10 + i for j in range(4)] for i in range(2)]))
            self.linear.bias.copy_(torch.tensor([0.5, -0.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def main() -> None:
    target = REPOSITORY / "torch_linear" / "1" / "model.pt"
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.exists():
        torch.jit.script(Linear()).save(str(target))
        print(f"wrote {target}")


if __name__ == "__main__":
    main()
