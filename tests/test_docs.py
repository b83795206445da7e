"""Issue 9, defects 19 and 20: the README and the proto comments tell the truth."""

from __future__ import annotations

import re
from pathlib import Path

from weightsync.common.collective import RENDEZVOUS_PREFIX

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_points_only_into_the_repo():
    assert "../shared" not in README
    for target in re.findall(r"\]\(([^)#]+)", README):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README links to {target}, which is not in the repo"
    assert "docs/architecture.md" in README


def test_readme_says_where_the_commands_are():
    assert ".venv/bin/weightsync" in README and "source .venv/bin/activate" in README


def test_readme_shows_the_cpu_form_of_serve_first():
    serves = [line for line in README.splitlines() if line.startswith("weightsync serve")]
    assert serves and "--device cpu" in serves[0] and "cuda" not in serves[0].split("#")[0]


def test_the_proto_names_the_real_rendezvous_prefix():
    proto = (ROOT / "protos/weightsync/v1/weight_sync_service.proto").read_text()
    start = proto.index("message CreateTransferGroupRequest")
    comment = proto[start : proto.index("string group_id = 1;", start)]
    assert f'PrefixStore("{RENDEZVOUS_PREFIX}<group_id>"' in comment
    assert "not init_process_group" in comment
