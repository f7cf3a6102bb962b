"""Where a checkpoint may be written, and how a new one replaces the old without losing anything.

Every writer of a checkpoint directory (save_pretrained, save_quantized, the trainer's saves, save_sharded,
export_safetensors, the `train` and `quantize` CLIs' --out) calls `check_output_dir` before it touches the
disk or loads anything heavy. It refuses:

- an empty path, or one with no name of its own: ".", "..", "a/..", a filesystem root;
- the working directory or any directory above it;
- something that exists and is not a directory;
- a non-empty directory that is not a directory of the kind being written (a user's project, a home);
- a `DIR.previous` that the swap would delete but that is not of that kind either;
- an output that equals or contains a source the writer reads (quantize --out X --checkpoint X).

The new contents are written into `.DIR.latentmoe-tmp-<pid>` beside DIR (a name no user file has), which
holds a marker file naming the process; the stale-temporary cleanup deletes only such directories whose
marker is there and whose process is gone, so it can never remove something a user made.
"""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

TEMPORARY_TAG = ".latentmoe-tmp-"
MARKER_NAME = ".latentmoe-temporary.json"  # inside a temporary directory: proves a save of ours made it
MARKER_FORMAT = "latentmoe-save-temporary-v1"


@dataclass(frozen=True)
class OutputKind:
    """What a writer produces: words for errors, how to recognise an existing one it may replace, and whether
    the writer swaps the whole directory (and so deletes `DIR.previous`)."""
    description: str
    recognise: Callable[[Path], bool]
    swapped: bool = True


def _is_checkpoint(directory: Path) -> bool:
    return (directory / "config.json").is_file() and ((directory / "model.safetensors").is_file()
                                                      or (directory / "model.safetensors.index.json").is_file())


def _is_run(directory: Path) -> bool:
    return (directory / "trainer_state.json").is_file() or (directory / "checkpoint").is_dir()


CHECKPOINT = OutputKind("a checkpoint directory (config.json with model.safetensors or its index)", _is_checkpoint)
RUN = OutputKind("a training run's output directory (trainer_state.json or checkpoint/)", _is_run, swapped=False)


def check_output_dir(path, *, sources: Iterable = (), name: str = "path", kind: OutputKind = CHECKPOINT) -> Path:
    """`path` as a Path when a writer of `kind` may write there, else ValueError (TypeError for a non-path)
    naming `name` and the rule (module docstring). `sources`: paths the writer reads (None entries skipped)."""
    if not isinstance(path, (str, os.PathLike)) or not isinstance(os.fspath(path), str):
        raise TypeError(f"{name}: expected a directory path (str or pathlib.Path), got {type(path).__name__}")
    text = os.fspath(path)
    if not text or "\0" in text:
        raise ValueError(f"{name}: the path is empty or holds a NUL byte; give the directory to write")
    target = Path(text)
    if target.name in ("", ".", ".."):
        raise ValueError(f"{name}: {text!r} names no directory of its own ('.', '..' or a root); "
                         f"give a new directory such as runs/out")
    resolved, cwd = target.resolve(), Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents:
        raise ValueError(f"{name}: {text!r} is the working directory or contains it; refusing to write a "
                         f"checkpoint over it")
    if target.exists() and not target.is_dir():
        raise ValueError(f"{name}: {text!r} exists and is not a directory")
    if target.is_dir() and any(target.iterdir()) and not kind.recognise(target):
        raise ValueError(f"{name}: {text!r} is a non-empty directory that is not {kind.description}; refusing "
                         f"to replace it (choose a new or empty directory)")
    previous = target.parent / f"{target.name}.previous"
    if kind.swapped and (previous.exists() or previous.is_symlink()) and not (
            previous.is_dir() and not previous.is_symlink() and kind.recognise(previous)):
        raise ValueError(f"{name}: {previous} exists and is not {kind.description}; the save would delete it "
                         f"(move it away first)")
    replaced = [resolved] + ([previous.resolve()] if kind.swapped else [])
    for source in sources:
        if source is None:
            continue
        read = Path(source).resolve()
        if any(read == out or out in read.parents for out in replaced):
            raise ValueError(f"{name}: {text!r} is or contains the source {os.fspath(source)!r}; writing there "
                             f"would replace what is being read (choose another output directory)")
    return target


# ---------------------------------------------------------------------------------------------- temporaries
def temporary_path(path: Path, pid: int) -> Path:
    """The temporary directory of a save of `path` by process `pid` (beside it, hidden, tagged)."""
    return path.parent / f".{path.name}{TEMPORARY_TAG}{pid}"


def make_temporary(path: Path, pid: int | None = None) -> Path:
    """Create the marked temporary directory for a save of `path` (after removing stale ones of dead saves)."""
    pid = os.getpid() if pid is None else pid
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    tmp = temporary_path(path, pid)
    if tmp.exists() or tmp.is_symlink():
        if not _made_by_us(tmp):
            raise ValueError(f"path: {tmp} exists and was not made by a save; move it away first")
        shutil.rmtree(tmp)  # our own leftover (this pid's earlier save, or a recycled pid)
    tmp.mkdir()
    (tmp / MARKER_NAME).write_text(json.dumps({"format": MARKER_FORMAT, "pid": pid, "target": path.name}))
    return tmp


@contextmanager
def writing_temporary(path: Path):
    """make_temporary(path) for the body to fill (and swap in); removed again if the body raises, so a
    failed save leaves nothing behind (a killed one is left to remove_stale_temporaries)."""
    tmp = make_temporary(path)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_stale_temporaries(path: Path) -> None:
    """Delete the temporaries of killed saves of `path`: marked by us, and their process no longer exists."""
    for entry in path.parent.glob(f".{path.name}{TEMPORARY_TAG}*"):
        pid = entry.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and _made_by_us(entry) and not _process_alive(int(pid)):
            shutil.rmtree(entry)


def _made_by_us(tmp: Path) -> bool:
    """A real directory (not a link) holding our marker for the pid in its name."""
    marker = tmp / MARKER_NAME
    if tmp.is_symlink() or not tmp.is_dir() or marker.is_symlink() or not marker.is_file():
        return False
    try:
        data = json.loads(marker.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return (isinstance(data, dict) and data.get("format") == MARKER_FORMAT
            and str(data.get("pid")) == tmp.name.rsplit("-", 1)[-1])


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---------------------------------------------------------------------------------------------- the swap
def swap_in(tmp: Path, path: Path, carried_over: Callable[[str], bool] | None = None) -> None:
    """Make the complete temporary `tmp` the directory `path`: old -> `path.previous`, tmp -> path, then the
    previous one and the marker are removed. carried_over(name): entries of the old directory to move into
    the new one (a README, a trainer log); None carries nothing over."""
    _give_files_default_modes(tmp)
    _fsync_tree(tmp)
    previous = path.parent / f"{path.name}.previous"
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"path: {path} exists and is not a directory")
        if carried_over is not None:
            for entry in path.iterdir():
                if carried_over(entry.name) and not (tmp / entry.name).exists():
                    os.rename(entry, tmp / entry.name)
        _remove(previous)
        os.rename(path, previous)
    os.rename(tmp, path)
    _fsync_dir(path.parent)
    (path / MARKER_NAME).unlink(missing_ok=True)
    _remove(previous)


def _remove(previous: Path) -> None:
    """Delete DIR.previous (check_output_dir made sure it is ours), or the link a linked DIR left there."""
    if previous.is_symlink():
        previous.unlink()
    elif previous.exists():
        shutil.rmtree(previous)


def _give_files_default_modes(directory: Path) -> None:
    """safetensors writes its files 0600; a checkpoint's files get the modes any file the user creates gets
    (0666 less the umask), so a checkpoint shared on a machine or in a container is readable as usual."""
    umask = os.umask(0)
    os.umask(umask)  # reading the umask means setting it; put it back at once
    for entry in directory.rglob("*"):
        if entry.is_file() and not entry.is_symlink():
            entry.chmod(0o666 & ~umask)


def _fsync_tree(directory: Path) -> None:
    for entry in directory.rglob("*"):
        if entry.is_file() and not entry.is_symlink():
            with open(entry, "rb") as handle:
                os.fsync(handle.fileno())
    for folder in [directory, *(p for p in directory.rglob("*") if p.is_dir())]:
        _fsync_dir(folder)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
