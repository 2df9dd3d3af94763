"""Claims in README.md and docs/ that are checked against the code or the committed result JSON."""

import json
from pathlib import Path

from titan_megamoe.integrations import launch

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
KERNELS = (REPO / "docs" / "kernels.md").read_text()
RESULTS = REPO / "docs" / "results"
HEADLINE_RUNS = ("bench_layer_20261203T065430.json", "bench_layer_20261203T065850.json")  # 09d6750, 9037870


def test_readme_names_the_entry_point_that_works_on_cpu():
    assert f"-m {launch.ENTRY_MODULE} --job.config_file" in README
    assert "_cuda_setDevice" in README  # and says why the plain route does not work there


def _ratios(arm: str, kind: str) -> list[str]:
    out = []
    for name in HEADLINE_RUNS:
        r = next(c for c in json.loads((RESULTS / name).read_text())["results"] if c["case"] == "30b-16k")
        out.append(f"{r[f'stock_{kind}_ms'] / r[f'{arm}_{kind}_ms']:.2f}x")
    return out


def test_layer_speedups_quote_the_expert_path_alone_first():
    alone_fwd, alone_fb = _ratios("fused_stock_router", "fwd"), _ratios("fused_stock_router", "fwdbwd")
    fused_fwd = _ratios("fused", "fwd")
    assert (alone_fwd, alone_fb) == (["2.21x", "2.43x"], ["1.95x", "2.00x"])  # what the JSON says
    for doc in (README, KERNELS):
        i_alone = doc.index(f"{alone_fwd[0]} / {alone_fwd[1]}" if doc is README else f"{alone_fwd[0]} and {alone_fwd[1]}")
        i_fused = doc.index(f"{fused_fwd[0]} / {fused_fwd[1]}" if doc is README else f"{fused_fwd[0]} and {fused_fwd[1]}",
                            doc.index("fused_stock_router"))
        assert i_alone < i_fused
    assert "1.95x / 2.00x" in README and "1.95x and 2.00x" in KERNELS


def test_relative_links_in_the_docs_point_at_committed_files():
    """Every relative Markdown link in README.md, docs/*.md and docs/results/*.md names a file or folder
    of the repository (anchors aside; code spans are not links)."""
    import re

    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted(RESULTS.glob("*.md"))]
    missing, checked = [], 0
    for page in pages:
        text = re.sub(r"`[^`\n]*`", "", page.read_text())
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            checked += 1
            if not (page.parent / target.split("#")[0]).exists():
                missing.append(f"{page.relative_to(REPO)}: {target}")
    assert checked > 50 and not missing, missing
