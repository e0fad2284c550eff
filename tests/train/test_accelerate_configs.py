"""The shipped ``accelerate`` configs parse with accelerate's own loader, name the launch that uses them, and
launch the training module (the header's command line)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("name", "kind", "processes"),
    [
        ("accelerate-2cpu.yaml", "MULTI_CPU", 2),
        ("accelerate-ddp.yaml", "MULTI_GPU", 8),
        ("accelerate-fsdp.yaml", "FSDP", 8),
    ],
)
def test_shipped_accelerate_configs_parse(name, kind, processes):
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
    from accelerate.utils import DistributedType

    path = ROOT / "configs" / name
    cfg = load_config_from_file(str(path))
    assert isinstance(cfg, ClusterConfig)
    assert cfg.distributed_type == DistributedType[kind] and cfg.num_processes == processes
    header = [line for line in path.read_text().splitlines() if line.startswith("#")]
    assert any(
        f"accelerate launch --config_file configs/{name}" in line and "-m selfspec.train" in line for line in header
    )
    if kind == "FSDP":
        assert cfg.fsdp_config["fsdp_version"] == 2 and cfg.fsdp_config["fsdp_state_dict_type"] == "FULL_STATE_DICT"
    else:
        assert cfg.fsdp_config == {}
