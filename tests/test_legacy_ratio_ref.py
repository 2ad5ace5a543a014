"""A run.yaml written before ``method.correction.ref`` existed reads as the rule it trained with:
in bypass mode its ratio corrections took rho against the current policy (ref: current); new
configs record the ratio's policy explicitly, so the two are told apart (runs/store.py)."""

import yaml

from masktrl.config import load_config
from masktrl.runs.store import RunStore, legacy_ratio_ref


def test_new_configs_record_the_ratio_policy_and_old_files_read_as_current(tmp_path):
    cfg = load_config(None, ["method.correction.kind=icepop"])
    assert cfg.method.to_dict()["correction"]["ref"] == "old"
    assert cfg.method.correction.ref == "old" and cfg.method.correction.needs_old
    # the default (no correction) is written exactly as before
    assert "correction" not in load_config(None, []).method.to_dict() or "ref" not in (
        load_config(None, []).method.to_dict().get("correction") or {}
    )
    old_file = {"method": {"name": "grpo", "correction": {"kind": "icepop"}}}
    assert legacy_ratio_ref(yaml.safe_load(yaml.safe_dump(old_file)))["method"]["correction"]["ref"] == "current"
    decoupled = {"method": {"name": "grpo", "correction": {"kind": "token-tis", "mode": "decoupled"}}}
    assert "ref" not in legacy_ratio_ref(decoupled)["method"]["correction"]
    # through the store: a run folder whose run.yaml predates ref
    root = tmp_path / "r"
    root.mkdir()
    (root / "run.yaml").write_text(yaml.safe_dump({"method": {"name": "grpo", "correction": {"kind": "token-tis"}}}))
    cfg_old = RunStore(root).config()
    assert cfg_old.method.correction.ratio_ref == "current" and not cfg_old.method.correction.needs_old
    # a new run's run.yaml round-trips with its ref
    (root / "run.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    assert RunStore(root).config().method.correction.ref == "old"
