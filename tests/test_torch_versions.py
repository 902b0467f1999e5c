"""rally installs beside any current torch: the requirement has a floor and
no ceiling, the floor is the oldest version .ci/torch-matrix tests, the README says which, the
CI install still pins the CPU wheel, and what differs between supported torches is detected
(torch.numa is absent from the oldest) and named in one line.

The matrix itself (a venv per torch, 4-6 GB each) is `bash .ci/torch-matrix`; its last result is
in the README.
"""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]


def torch_requirement() -> Requirement:
    """The torch requirement of the installed torch-rally (what pip resolves against)."""
    (text,) = [r for r in metadata.requires("torch-rally") or [] if Requirement(r).name == "torch"]
    return Requirement(text)


def matrix_versions() -> tuple[str, str]:
    script = (REPO / ".ci/torch-matrix").read_text()
    oldest = re.search(r"^OLDEST=(\S+)", script, re.M)
    newest = re.search(r"^NEWEST=(\S+)", script, re.M)
    assert oldest and newest, "OLDEST= and NEWEST= in .ci/torch-matrix"
    return oldest.group(1), newest.group(1)


@pytest.mark.timeout(30)
def test_the_requirement_has_the_tested_floor_and_no_ceiling():
    requirement = torch_requirement()
    oldest, newest = matrix_versions()
    assert [(s.operator, s.version) for s in requirement.specifier] == [
        (">=", Version(oldest).base_version.rsplit(".", 1)[0])
    ]
    for version in (oldest, newest, "2.14.0", "2.14.1", metadata.version("torch").split("+")[0], "3.0.0"):
        assert requirement.specifier.contains(version), f"{requirement} refuses torch {version}"
    assert not requirement.specifier.contains("2.4.1")  # seen to fail (README)


@pytest.mark.timeout(30)
def test_the_docs_name_the_tested_versions_and_the_ci_install_still_pins_the_cpu_wheel():
    """The matrix is documented in docs/contributing.md; the README's install section names the floor."""
    page = (REPO / "docs" / "contributing.md").read_text()
    oldest, newest = matrix_versions()
    section = page[page.index("## Supported torch versions") :]
    section = section[: section.index("\n## ")] if "\n## " in section else section
    floor = ".".join(oldest.split(".")[:2])
    assert f"**torch {floor} or any later release**" in (REPO / "README.md").read_text()
    assert f"**torch {oldest} and every release after it**" in section
    assert re.search(rf"\| {re.escape(newest)} \(newest\) \| \d+ passed", section), section
    assert re.search(rf"\| {re.escape(oldest)} \(oldest supported\) \| \d+ passed", section), section
    assert "bash .ci/torch-matrix" in section
    install = (REPO / ".ci/install").read_text()
    assert install.index('"torch==2.13.0"') < install.index('-e ".[test,gpu')


@pytest.mark.timeout(60)
def test_a_torch_without_numa_binding_is_one_line_at_launch(tmp_path):
    """The oldest supported torch has no torch.numa: --numa-binding says so instead of a traceback.
    Run on any torch by hiding the module in a fresh interpreter."""
    code = (
        "import sys; sys.modules['torch.numa'] = None; sys.modules['torch.numa.binding'] = None\n"
        "from rally.agent.base.numa import NumaBindingError, cpus_near_gpu\n"
        "try:\n    cpus_near_gpu('node', 0)\nexcept NumaBindingError as exc:\n    print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50, cwd=tmp_path)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert re.fullmatch(
        r"--numa-binding node: this torch \(\S+\) has no torch\.numa\.binding, which picks the CPUs; upgrade "
        r"torch \(2\.13 has it\)\n",
        done.stdout,
    ), done.stdout
