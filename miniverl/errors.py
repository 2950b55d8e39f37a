"""The errors miniverl raises on purpose; each message names the problem and its fix."""

from __future__ import annotations


class MiniVerlError(Exception):
    """A problem the user can fix; the message names the problem and the fix."""


class ConfigError(MiniVerlError):
    """The configuration (or what it points at) cannot work."""


class BatchError(MiniVerlError, ValueError):
    """A batch violates its contract (shape, dtype or mask)."""


class PolicyMismatchError(MiniVerlError):
    """Strict sync was violated: data or an engine does not match the published policy."""


class NonFiniteError(MiniVerlError):
    """A NaN or inf loss, gradient or weight; nothing poisoned was applied, published or saved."""


class DiskFullError(MiniVerlError):
    """A write failed because the disk (or the user's quota) is full; the message names the file and the fix."""


# Below this much free space after a failed write, the disk is taken to be what failed it: torch.save reports a full
# disk as RuntimeError("... file write failed") and safetensors as its own error, neither with an errno.
FULL_DISK_BYTES = 64 << 20
FULL_DISK_TEXTS = ("No space left on device", "Disk quota exceeded", "StorageFull")


def disk_full(error: BaseException, path, fix: str) -> DiskFullError | None:
    """A DiskFullError naming `path` and `fix` (what to do once space is freed) when `error`, raised while writing
    `path`, came from a full disk or quota: an OSError with errno ENOSPC or EDQUOT anywhere in its chain, the
    system's words for it in its text, or less than FULL_DISK_BYTES left where `path` is; else None."""
    import errno
    import shutil
    from pathlib import Path

    chain, seen = [], error
    while seen is not None and len(chain) < 8:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    errnos = {e.errno for e in chain if isinstance(e, OSError) and e.errno is not None}
    by_errno = bool(errnos & {errno.ENOSPC, errno.EDQUOT})
    by_text = any(text in str(e) for e in chain for text in FULL_DISK_TEXTS)
    where = next((p for p in (Path(path), *Path(path).parents) if p.exists()), None)
    free = shutil.disk_usage(where).free if where is not None else None
    # An errno that is not a full disk (EACCES, EROFS) says what failed; free space is asked only when none does.
    by_space = not errnos and free is not None and free < FULL_DISK_BYTES
    if not (by_errno or by_text or by_space):
        return None
    left = f" ({free / 2**20:.0f} MiB left there)" if free is not None else ""
    return DiskFullError(f"the disk is full while writing {path}; free space on it{left}, then {fix}")


def message_of(error: BaseException) -> str:
    """The message of `error` as raised: for one raised in a Ray actor (Ray's RayTaskError subclasses the raised
    class, and its text is the remote traceback), the raised error's own."""
    cause = getattr(error, "cause", None)
    return str(cause if isinstance(cause, BaseException) else error).strip()
