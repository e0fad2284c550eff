"""The checks every head config shares (selfspec.heads.config): target layers, head type and draft vocabulary, and
the one wrong-target check (selfspec.heads.io.check_fingerprint) with and without a recorded fingerprint."""

from __future__ import annotations

import logging

import pytest

from selfspec.heads.config import HeadFormatError, check_family_fields, check_layer_ids
from selfspec.heads.dflash import BlockConfig
from selfspec.heads.eagle3 import Eagle3Config
from selfspec.heads.io import check_fingerprint
from selfspec.train.config import BlockOptions, Eagle3Options


def test_layer_ids_are_checked_against_their_range_and_count():
    assert check_layer_ids("f", [0, 3, 5], 0, 5) == (0, 3, 5)
    assert check_layer_ids("f", (2,), 0) == (2,)  # no upper bound before the target is known
    with pytest.raises(HeadFormatError, match=r"f must be layer indices, each \[0, 5\]; got \(0, 6\)"):
        check_layer_ids("f", [0, 6], 0, 5)
    with pytest.raises(HeadFormatError, match=r"f must be 3 layer indices, each >= 0; got \(1, 2\)"):
        check_layer_ids("f", [1, 2], 0, count=3)
    with pytest.raises(HeadFormatError, match="got \\(\\)"):
        check_layer_ids("f", [], 0, 5)
    with pytest.raises(HeadFormatError, match="integers"):
        check_layer_ids("f", [1.5], 0, 5)


def test_eagle3_and_block_configs_and_their_options_share_the_layer_check():
    """EAGLE-3 takes layer inputs (``[0, L - 1]``), the block heads layer outputs (``[0, L - 2]``): one function, one
    error type, the range in the message."""
    assert Eagle3Config(8, 16, 16, 4, target_layers=(0, 2, 3)).target_layers == (0, 2, 3)
    with pytest.raises(HeadFormatError, match=r"target_layers must be 3 layer indices, each \[0, 3\]"):
        Eagle3Config(8, 16, 16, 4, target_layers=(0, 2))
    with pytest.raises(HeadFormatError, match=r"target_layers must be layer indices, each \[0, 3\]; got \(0, 2, 4\)"):
        Eagle3Config(8, 16, 16, 4, target_layers=(0, 2, 4))
    block = dict(head_type="dflash", hidden_size=8, vocab_size=16, num_target_layers=4, block_size=4, num_layers=1)
    assert BlockConfig(**block, mask_token_id=15, target_layer_ids=(0, 2)).target_layer_ids == (0, 2)
    with pytest.raises(HeadFormatError, match=r"target_layer_ids must be layer indices, each \[0, 2\]; got \(3,\)"):
        BlockConfig(**block, mask_token_id=15, target_layer_ids=(3,))
    with pytest.raises(HeadFormatError, match="eagle3.target_layers must be 3 layer indices"):
        Eagle3Options(target_layers=(1, 2))
    with pytest.raises(HeadFormatError, match="block.target_layer_ids must be layer indices, each >= 0"):
        BlockOptions(target_layer_ids=(-1, 2))


def test_family_fields():
    check_family_fields("eagle", "eagle", None, 16)
    check_family_fields("dspark", ("dflash", "dspark"), 16, 16)
    with pytest.raises(HeadFormatError, match="head_type 'medusa' is not 'eagle'"):
        check_family_fields("medusa", "eagle", None, 16)
    with pytest.raises(HeadFormatError, match=r"head_type 'eagle' is not one of \('dflash', 'dspark'\)"):
        check_family_fields("eagle", ("dflash", "dspark"), None, 16)
    with pytest.raises(HeadFormatError, match=r"draft_vocab_size must be in \[1, vocab_size=16\]"):
        check_family_fields("eagle", "eagle", 17, 16)


def test_the_wrong_target_check(caplog):
    check_fingerprint("d", "abc", "abc")
    check_fingerprint("d", "abc", None)  # no target to check against
    with pytest.raises(HeadFormatError, match=r"heads in d were trained on another target \(fingerprint abc\), not on"):
        check_fingerprint("d", "abc", "xyz")
    with pytest.raises(HeadFormatError, match="trained on target 'tiny'.*load them with their own target, or retrain"):
        check_fingerprint("d", "abc", "xyz", "tiny")
    with caplog.at_level(logging.WARNING, logger="selfspec.heads.io"):
        check_fingerprint("published", "", "xyz", unrecorded_warning=False)
        assert not caplog.records
        check_fingerprint("ours", "", "xyz")
    assert "carry no target fingerprint" in caplog.records[0].getMessage()
