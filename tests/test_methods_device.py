"""The rule library (``masktrl/methods``) and the trainer integrations run on whatever device the
batch is on: every tensor they create with a shape names its device (or is a 0-dim scalar, which
torch lets CPU tensors be beside any device), and the seeded uniforms they draw on the CPU are
moved to the batch's device where they are read. A plain masktrl run on a GPU failed in ``sis``
and ``trm`` on exactly this before the rule held (docs/BENCHMARKS.md §4); no GPU runs here, so
this reads the source."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FACTORIES = {"zeros", "ones", "full", "empty", "arange", "tensor", "as_tensor", "rand", "randn", "linspace", "eye"}
# file -> why its shaped tensors may stay on the CPU
CPU_BY_DESIGN = {
    # rewards arrive as python floats; the advantages are computed on the CPU in float64 and move
    # with the batch (rl/policy.py) or are made by the trainer (integrations)
    "masktrl/methods/advantages.py": "advantages from python rewards, on the CPU",
    # the self-check's own random batches (CPU only, not a training path)
    "masktrl/integrations/tokens.py": "a self-check on CPU batches",
}
SEEDED_STREAM = "generator"  # torch.rand(n, generator=gen): a seeded CPU stream, moved where read


def _unplaced(path: Path, root: Path = ROOT) -> list[str]:
    """``file:line`` of every torch factory call with a shape and no ``device=``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        f = node.func
        if not (isinstance(f.value, ast.Name) and f.value.id == "torch" and f.attr in FACTORIES):
            continue
        keywords = {k.arg for k in node.keywords}
        if "device" in keywords or SEEDED_STREAM in keywords:
            continue
        first = node.args[0] if node.args else None
        scalar = (isinstance(first, ast.Tuple) and not first.elts) or (
            f.attr == "tensor" and isinstance(first, ast.Constant)
        )
        if not scalar:
            out.append(f"{path.relative_to(root)}:{node.lineno}")
    return out


def test_every_shaped_tensor_of_the_rule_library_names_its_device():
    files = sorted((ROOT / "masktrl" / "methods").glob("*.py")) + sorted(
        (ROOT / "masktrl" / "integrations").glob("*.py")
    )
    bad = [hit for p in files if str(p.relative_to(ROOT)) not in CPU_BY_DESIGN for hit in _unplaced(p)]
    assert bad == []


def test_the_check_finds_an_unplaced_tensor(tmp_path):
    src = tmp_path / "example.py"
    lines = [
        "import torch",
        "x = torch.zeros(3)",
        "y = torch.zeros((), dtype=torch.float64)",
        "z = torch.ones(2, device='cpu')",
    ]
    src.write_text("\n".join(lines) + "\n")
    assert _unplaced(src, tmp_path) == ["example.py:2"]
