"""Backends: how a model of each kind becomes something Triton serves.

The interface is declared on the repository's side (server.repository.backend), so the repository imports no
backend: a `ModelBackend` stages a model (lists it in Triton's index), loads it (serves its chosen versions, or
raises LoadError with the reason) and unloads it; the `Placeholder` lists a model nothing can serve as UNAVAILABLE
with its reason.

One file per kind of model:

    python.py       Triton Python-backend models (model.py), staged for Triton's own Python backend
    pytorch.py      TorchScript models, staged with a runner for the same Python backend
    onnx.py         ONNX models, staged with a runner (onnxruntime) for the same Python backend
    openvino.py     OpenVINO IR models, the same runner on openvino (an extra)
    ensemble.py     ensembles: staged as Python models are, run by Triton's core; a failure listed with its reason
    llm.py          LLM models: Strata's engine bound through PyTriton with the vLLM backend's inputs and outputs
    unavailable.py  the placeholder for broken models (and for LLM models whose engine is not running)

python, pytorch, onnx, openvino and ensembles share `staging.StagedBackend` and differ only in how the folder is staged. `registry` maps the
backend names of server.repository.model_config to these; `strata serve` builds it and hands it to the
`RepositoryManager`. A new kind of model is a new file here, a name in model_config and an entry in `registry`.
"""

from __future__ import annotations

from server.backends import onnx, openvino, python, pytorch
from server.backends.ensemble import EnsembleBackend
from server.backends.staging import ModelLoader, StagedBackend
from server.backends.unavailable import UnavailableBackend
from server.repository.backend import BackendRegistry, ModelBackend
from server.repository.model_config import ENSEMBLE, LIBTORCH, LLM_BACKENDS, ONNXRUNTIME, OPENVINO, PYTHON


def registry(triton: ModelLoader, llm: ModelBackend | None = None) -> BackendRegistry:
    """The backends of this server by name; `llm` (server.backends.llm.LLMBackend) serves LLM models if given."""
    backends: dict[str, ModelBackend] = {
        PYTHON: StagedBackend(triton, python.stage),
        LIBTORCH: StagedBackend(triton, pytorch.stage),
        ONNXRUNTIME: StagedBackend(triton, onnx.stage),
        OPENVINO: StagedBackend(triton, openvino.stage),
        ENSEMBLE: EnsembleBackend(triton),
    }
    if llm is not None:
        for name in LLM_BACKENDS:  # Strata's engine and vLLM: one binding, the deployment picks the engine
            backends[name] = llm
    return BackendRegistry(backends, UnavailableBackend(triton))
