"""The bounded YAML and JSON readers (masktrl/readers.py): every hostile file ends in one
MasktrlError line naming the file, in bounded time and memory."""

import json

import pytest

from masktrl.errors import ArtifactError, ConfigError, DataError
from masktrl.readers import MAX_DEPTH, MAX_NODES, json_depth, load_json, load_yaml, read_json, read_yaml


def refused(exc_info) -> str:
    line = str(exc_info.value)
    assert "\n" not in line, line
    return line


# --------------------------------------------------------------------------- YAML


def test_plain_yaml_reads_as_safe_load():
    text = "seed: 3\ntrain:\n  lr: 1.0e-3\n  steps: 5\nmethod: {name: dppo, divergence: topk-tv}\nlist: [1, 2, 3]\n"
    assert load_yaml(text, "c.yaml") == {
        "seed": 3,
        "train": {"lr": 1e-3, "steps": 5},
        "method": {"name": "dppo", "divergence": "topk-tv"},
        "list": [1, 2, 3],
    }
    assert load_yaml("", "empty.yaml") is None


def test_duplicate_section_is_refused_naming_key_lines_and_file():
    text = "train:\n  steps: 5\nseed: 1\ntrain:\n  lr: 0.1\n"
    with pytest.raises(ConfigError) as e:
        load_yaml(text, "dup.yaml")
    assert refused(e) == "dup.yaml: duplicate key 'train' (lines 1 and 4): give each key once"


def test_duplicate_nested_key_is_refused():
    with pytest.raises(ConfigError, match=r"nested.yaml: duplicate key 'lr' \(lines 2 and 3\)"):
        load_yaml("train:\n  lr: 1\n  lr: 2\n", "nested.yaml")


def test_merge_key_override_is_not_a_duplicate():
    text = "base: &b {lr: 1, steps: 2}\ntrain:\n  <<: *b\n  lr: 3\n"
    assert load_yaml(text, "m.yaml")["train"] == {"lr": 3, "steps": 2}


def test_five_thousand_deep_yaml_is_one_line():
    for text in (
        "[" * 5000 + "]" * 5000,
        "a: " + "{a: " * 5000 + "1" + "}" * 5000,
        "".join(f"{' ' * i}- \n" for i in range(0, 5000, 1)),
    ):
        with pytest.raises(ConfigError) as e:
            load_yaml(text, "deep.yaml")
        line = refused(e)
        assert line.startswith("deep.yaml: nested deeper than 64 levels") or line.startswith(
            "cannot parse deep.yaml"
        ), line


def test_depth_limit_is_exact():
    assert load_yaml("[" * MAX_DEPTH + "]" * MAX_DEPTH, "ok.yaml") is not None
    with pytest.raises(ConfigError, match="nested deeper than 64 levels"):
        load_yaml("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), "deep.yaml")


def test_recursive_alias_is_refused():
    for text in ("a: &a [*a]\n", "a: &a {b: *a}\n", "a: &a [1, [2, *a]]\n"):
        with pytest.raises(ConfigError) as e:
            load_yaml(text, "rec.yaml")
        assert refused(e).startswith("rec.yaml: recursive alias *a (line 1)")


def alias_bomb(levels: int = 9, width: int = 9) -> str:
    lines = [f"l0: &l0 [{', '.join(['x'] * width)}]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_alias_bomb_is_refused_quickly():
    with pytest.raises(ConfigError) as e:
        load_yaml(alias_bomb(), "bomb.yaml")  # 9^9 = 387 million values once expanded
    assert refused(e).startswith(f"bomb.yaml: its aliases expand to more than {MAX_NODES:,} values")


def test_aliases_within_the_limit_are_fine():
    text = "base: &b {lr: 1, steps: 2}\na: *b\nb: *b\nc: [*b, *b]\n"
    data = load_yaml(text, "ok.yaml")
    assert data["c"] == [{"lr": 1, "steps": 2}] * 2


def test_alias_that_deepens_past_the_limit_is_refused():
    inner = "[" * 40 + "]" * 40
    with pytest.raises(ConfigError, match="nested deeper than 64 levels once its aliases are expanded"):
        load_yaml(f"a: &a {inner}\nb: [{'[' * 30}*a{']' * 30}]\n", "d.yaml")


def test_unsafe_tags_and_syntax_errors_are_one_line():
    with pytest.raises(ConfigError) as e:
        load_yaml("a: !!python/object/apply:os.system ['true']\n", "evil.yaml")
    assert refused(e).startswith("cannot parse evil.yaml: could not determine a constructor")
    with pytest.raises(ConfigError) as e:
        load_yaml("a: [1, 2\nb: 3\n", "bad.yaml")
    assert refused(e).startswith("cannot parse bad.yaml:") and "line" in str(e.value)


def test_non_utf8_yaml_names_the_line():
    with pytest.raises(ConfigError) as e:
        load_yaml(b"seed: 1\ntask:\n  name: ar\xffith\n", "latin.yaml")
    assert refused(e) == "latin.yaml: not UTF-8 text (byte 0xff on line 3)"
    assert load_yaml(b"\xef\xbb\xbfseed: 2\n", "bom.yaml") == {"seed": 2}


def test_read_yaml_uses_the_error_type_asked_for(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("seed: 1\nseed: 2\n")
    with pytest.raises(ArtifactError, match="run.yaml: duplicate key 'seed'"):
        read_yaml(path, error=ArtifactError)


# --------------------------------------------------------------------------- JSON


def test_json_reads_plain_values():
    assert load_json('{"a": [1, 2.5, "x", null, true]}', "s.json") == {"a": [1, 2.5, "x", None, True]}


@pytest.mark.parametrize("depth", [5000, 100_000])
def test_deep_json_is_one_line(tmp_path, depth):
    path = tmp_path / "summary.json"
    path.write_text('{"a": ' * depth + "1" + "}" * depth)
    with pytest.raises(DataError) as e:
        read_json(path)
    assert refused(e) == f"{path}: JSON nested deeper than {MAX_DEPTH} levels"


def test_json_depth_limit_is_exact():
    ok = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert json_depth(load_json(ok, "ok.json")) == MAX_DEPTH
    with pytest.raises(DataError, match="nested deeper"):
        load_json("[" + ok + "]", "deep.json")


@pytest.mark.parametrize(
    "text, needle",
    [
        ('{"x": NaN}', "NaN is not a finite number"),
        ('{"x": -Infinity}', "-Infinity is not a finite number"),
        ('{"x": 1e400}', "the number 1e400 is too large for a float"),
    ],
)
def test_json_non_finite_numbers_are_refused(text, needle):
    with pytest.raises(DataError) as e:
        load_json(text, "m.json")
    assert refused(e) == f"m.json: {needle}"
    assert load_json(text, "m.json", finite=False)["x"] != 0  # allowed when asked for


def test_broken_and_non_utf8_json_are_one_line():
    with pytest.raises(DataError) as e:
        load_json('{"a": [1, 2}', "b.json")
    assert refused(e).startswith("b.json: not valid JSON (") and "line 1" in str(e.value)
    with pytest.raises(DataError) as e:
        load_json(b'{"a": "\xc3"}', "u.json")
    assert refused(e) == "u.json: not UTF-8 text (byte 0xc3 on line 1)"
    with pytest.raises(DataError) as e:
        load_json("1" * 5000, "big.json")  # more digits than Python converts
    assert refused(e).startswith("big.json: not valid JSON")


def test_json_round_trip_of_a_manifest_like_value():
    value = {"stages": {"ckpt/000002": {"status": "done", "files": {"model.safetensors": "ab" * 32}, "step": 2}}}
    assert load_json(json.dumps(value), "manifest.json", error=ArtifactError) == value
