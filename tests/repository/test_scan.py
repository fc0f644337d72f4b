"""Repository parsing and version selection: each bad input names the file, the line and the field."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from harness.servers import EXAMPLE_REPOSITORY
from server import backends
from server.backends.staging import RUNNER
from server.repository.manager import ControlMode, ModelEntry, RepositoryManager, load_order
from server.repository.scan import BrokenModel, ModelSource, read_model, scan

GOOD = """name: "m"
backend: "python"
max_batch_size: 4
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""


def make_model(
    root: Path, config: str = GOOD, versions=(1,), name: str = "m", filename: str = "model.py"
) -> Path:
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(config)
    for version in versions:
        (folder / str(version)).mkdir(exist_ok=True)
        (folder / str(version) / filename).write_text("# model\n")
    return folder


def error_of(folder: Path) -> str:
    model = read_model(folder)
    assert isinstance(model, BrokenModel), model
    return str(model.error)


def test_example_repository_parses():
    models = scan([EXAMPLE_REPOSITORY])
    assert all(isinstance(m, ModelSource) for m in models.values()), models
    add_sub = models["add_sub"]
    assert add_sub.versions == [1, 2]
    assert add_sub.config.dynamic_batching.preferred_batch_size == [8, 16]
    assert add_sub.config.instance_group[0].count == 1
    assert models["torch_linear"].backend == "pytorch"


def test_syntax_error_names_file_and_line(tmp_path):
    folder = make_model(tmp_path, GOOD.replace("output [ {", "output [ {{"))
    assert error_of(folder).startswith(f"{folder / 'config.pbtxt'}:5:")


def test_unknown_field_names_line_and_field(tmp_path):
    folder = make_model(tmp_path, GOOD + "\nmax_batch_sizes: 8\n")
    message = error_of(folder)
    assert f"{folder / 'config.pbtxt'}:7:1" in message and "max_batch_sizes" in message


def test_name_mismatch(tmp_path):
    folder = make_model(tmp_path, GOOD.replace('name: "m"', 'name: "other"'))
    message = error_of(folder)
    assert ":1:" in message and '"other"' in message and '"m"' in message


def test_missing_version_folder(tmp_path):
    folder = make_model(tmp_path, versions=())
    assert "no version folder" in error_of(folder)


def test_specific_version_policy_names_missing_version(tmp_path):
    folder = make_model(
        tmp_path, GOOD + "version_policy: { specific: { versions: [ 1, 3 ] } }\n", versions=(1, 2)
    )
    assert "[3]" in error_of(folder)


def test_missing_model_file(tmp_path):
    folder = make_model(tmp_path, filename="other.py")
    assert "model.py" in error_of(folder)


def test_unsupported_backend_names_field(tmp_path):
    folder = make_model(tmp_path, GOOD.replace('backend: "python"', 'backend: "tensorflow"'))
    message = error_of(folder)
    assert ":2:" in message and "backend" in message and "tensorflow" in message and "deprecated" in message


def test_a_gpu_only_platform_is_refused_with_the_reason(tmp_path):
    folder = make_model(tmp_path, GOOD.replace('backend: "python"', 'platform: "tensorrt_plan"'))
    assert 'platform "tensorrt_plan": TensorRT plans run on NVIDIA GPUs only' in error_of(folder)


def test_a_folder_without_config_is_completed_from_its_model_file(tmp_path):
    folder = tmp_path / "auto"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.onnx").write_bytes(b"")
    model = read_model(folder)
    assert isinstance(model, ModelSource) and model.backend == "onnxruntime" and model.config.name == "auto"
    (folder / "2").mkdir()
    (folder / "2" / "model.py").write_text("# model\n")
    assert read_model(folder).backend == "python"  # the newest version's file decides


def test_without_auto_complete_a_folder_needs_its_config(tmp_path):
    folder = tmp_path / "auto"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.onnx").write_bytes(b"")
    model = read_model(folder, auto_complete=False)
    assert isinstance(model, BrokenModel) and "--disable-auto-complete-config" in str(model.error)
    (folder / "1" / "model.onnx").rename(folder / "1" / "weights.bin")
    assert "no version folder holds a file auto-complete knows" in str(read_model(folder).error)


def test_an_ensemble_needs_no_model_file_and_loads_after_its_steps(tmp_path):
    ensemble = """name: "e"
platform: "ensemble"
max_batch_size: 4
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] } ]
ensemble_scheduling { step [ { model_name: "z" model_version: -1 input_map { key: "X" value: "X" }
  output_map { key: "Y" value: "Y" } } ] }
"""
    folder = make_model(tmp_path, ensemble, name="e", filename="unused")
    (folder / "1" / "unused").unlink()
    make_model(tmp_path, GOOD.replace('"m"', '"z"'), name="z")
    make_model(tmp_path, GOOD.replace('"m"', '"a"'), name="a")
    models = scan([tmp_path])
    assert isinstance(models["e"], ModelSource) and models["e"].model_filename == ""
    entries = {name: ModelEntry(model) for name, model in models.items()}
    assert load_order(entries, {"a", "e", "z"}) == ["a", "z", "e"]


@pytest.mark.parametrize(
    "policy, expected",
    [
        ("", [3]),
        ("version_policy: { latest: { num_versions: 2 } }", [2, 3]),
        ("version_policy: { all: {} }", [1, 2, 3]),
        ("version_policy: { specific: { versions: [ 1 ] } }", [1]),
    ],
)
def test_version_policy(tmp_path, policy, expected):
    model = read_model(make_model(tmp_path, GOOD + policy, versions=(1, 2, 3)))
    assert isinstance(model, ModelSource) and model.versions == expected


def test_duplicate_name_across_repositories(tmp_path):
    make_model(tmp_path / "a")
    make_model(tmp_path / "b")
    model = scan([tmp_path / "a", tmp_path / "b"])["m"]
    assert isinstance(model, BrokenModel) and "unique" in str(model.error)


class RecordingLoader:
    """Stands in for Triton to test the manager's poll logic with the real file backends (the server tests use
    real Triton)."""

    def __init__(self, store: Path) -> None:
        self.store = store
        self.loads: list[str] = []
        self.unloads: list[str] = []

    def load(self, name: str) -> None:
        self.loads.append(name)

    def unload(self, name: str) -> None:
        self.unloads.append(name)

    def wait_unloaded(self, name: str) -> None:
        pass


def started_poll_manager(tmp_path: Path) -> tuple[Path, RecordingLoader, RepositoryManager]:
    """A poll-mode manager over a one-model repository, started (its watcher stopped: tests call rescan)."""
    repo = tmp_path / "repo"
    make_model(repo)
    loader = RecordingLoader(tmp_path / "store")
    loader.store.mkdir()
    manager = RepositoryManager([repo], backends.registry(loader), ControlMode.POLL, poll_secs=3600)
    manager.start()
    manager.stop()
    return repo, loader, manager


def test_poll_applies_a_change_only_once_files_are_stable(tmp_path):
    repo, loader, manager = started_poll_manager(tmp_path)
    assert loader.loads == ["m"]
    (repo / "m" / "2").mkdir()
    (repo / "m" / "2" / "model.py").write_text("# half")
    manager.rescan()  # first sight of the change: wait
    (repo / "m" / "2" / "model.py").write_text("# half written, then complete\n")
    manager.rescan()  # changed again since last scan: still wait
    assert loader.loads == ["m"]
    manager.rescan()  # same files twice: apply
    assert loader.loads == ["m", "m"]
    assert (loader.store / "m" / "2").is_symlink()
    shutil.rmtree(repo / "m")
    manager.rescan()
    manager.rescan()
    assert loader.unloads == ["m"] and not (loader.store / "m").exists()


def test_poll_keeps_serving_version_when_config_breaks(tmp_path):
    repo, loader, manager = started_poll_manager(tmp_path)
    staged_config = (loader.store / "m" / "config.pbtxt").read_text()
    (repo / "m" / "config.pbtxt").write_text(GOOD + "bogus_field: 1\n")
    manager.rescan()
    manager.rescan()
    assert loader.loads == ["m"]
    assert (loader.store / "m" / "config.pbtxt").read_text() == staged_config
    assert "bogus_field" in manager.entries["m"].error


def test_a_model_no_backend_serves_is_listed_with_its_reason(tmp_path):
    repo = tmp_path / "repo"
    make_model(repo, GOOD.replace("max_batch_size: 4", "max_batch_size 4"), name="broken")
    make_model(repo, 'name: "llm"\nbackend: "strata_llm"\n', name="llm", filename="model.json")
    loader = RecordingLoader(tmp_path / "store")
    loader.store.mkdir()
    manager = RepositoryManager([repo], backends.registry(loader), ControlMode.NONE)  # no LLM backend here
    manager.start()
    assert sorted(loader.loads) == ["broken", "llm"]  # the placeholders: Triton's load fails with the reason
    assert "broken/config.pbtxt:3:16" in (loader.store / "broken" / "config.pbtxt").read_text()
    assert 'backend \\"strata_llm\\" is not enabled' in (loader.store / "llm" / "config.pbtxt").read_text()
    assert manager.entries["llm"].serving is None


QA_WRONG_MODEL = """# Triton QA's python_models/wrong_model: its config names another model
name: "identity_fp32"
backend: "python"
platform: "custom"
max_batch_size: 64
input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""


def test_poll_lists_a_new_model_whose_config_names_another_as_unavailable(tmp_path):
    """Found when the config is parsed: the folder goes to the placeholder (Triton's index shows it UNAVAILABLE
    with the reason, naming the file, line and field), its model.py never reaches Triton, and m keeps serving."""
    repo, loader, manager = started_poll_manager(tmp_path)
    make_model(repo, QA_WRONG_MODEL, name="wrong_model")
    manager.rescan()
    manager.rescan()
    assert loader.loads == ["m", "wrong_model"] and loader.unloads == []
    reason = manager.entries["wrong_model"].error
    assert f"{repo / 'wrong_model' / 'config.pbtxt'}:2: name " in reason and '"identity_fp32"' in reason
    staged = loader.store / "wrong_model"
    assert "strata_error" in (staged / "config.pbtxt").read_text()
    assert (
        staged / "1" / "model.py"
    ).resolve() == RUNNER.resolve()  # the placeholder, not the operator's file
    assert manager.entries["m"].serving is not None


def test_a_config_that_is_not_utf8_is_one_broken_model(tmp_path):
    """An unreadable config breaks its own model only: the scan (and poll mode's watcher) goes on."""
    make_model(tmp_path, name="m")
    folder = make_model(tmp_path, name="latin1")
    (folder / "config.pbtxt").write_bytes(b'name: "latin1"\n# caf\xe9\nbackend: "python"\n')
    models = scan([tmp_path])
    assert isinstance(models["m"], ModelSource)
    assert isinstance(models["latin1"], BrokenModel) and "cannot read" in str(models["latin1"].error)
    assert str(folder / "config.pbtxt") in str(models["latin1"].error)


def test_openvino_without_its_wheel_is_refused_naming_the_extra(tmp_path, monkeypatch):
    from server.backends import openvino

    folder = make_model(
        tmp_path, GOOD.replace('backend: "python"', 'backend: "openvino"'), filename="model.xml"
    )
    model = read_model(folder)
    assert isinstance(model, ModelSource)
    monkeypatch.setattr(openvino.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(openvino.MissingExtra, match=r"strata\[openvino\]"):
        openvino.stage(model, tmp_path / "store")


def test_an_ensemble_with_an_llm_step_is_refused_naming_the_step(tmp_path):
    ensemble = """name: "qa"
platform: "ensemble"
input [ { name: "Q" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "A" data_type: TYPE_STRING dims: [ 1 ] } ]
ensemble_scheduling { step [
  { model_name: "llm" model_version: -1 input_map { key: "text_input" value: "Q" }
    output_map { key: "text_output" value: "A" } } ] }
"""
    make_model(tmp_path, ensemble, name="qa", filename=".keep")
    make_model(tmp_path, 'name: "llm"\nbackend: "strata_llm"\n', name="llm", filename="model.json")
    models = scan([tmp_path])
    assert isinstance(models["llm"], ModelSource) and isinstance(models["qa"], BrokenModel)
    message = str(models["qa"].error)
    assert ":6:" in message and 'step "llm" is an LLM model (backend strata_llm)' in message
