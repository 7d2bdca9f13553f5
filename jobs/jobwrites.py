"""The one way a privileged process changes a job's folder: the host agent (root, when it runs
jobs under their owners' accounts) and the event consumer (root under ``./edt up``).

A job's account owns everything below its result folder. It can swap any entry there for a
link, rename a folder away or put another in its place at any moment, also halfway through
the agent's work; a check by path (``is_symlink()``, ``exists()``) proves nothing a moment
later. So below the result folder nothing is created, written, changed or removed by path:

- a folder is entered from its parent's descriptor with ``O_DIRECTORY | O_NOFOLLOW``: a link
  fails (``ELOOP``), and so does anything that is not a folder (``ENOTDIR``) before any device
  or FIFO behind it is opened;
- a file is created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` relative to its folder's descriptor:
  never an existing file, never through a link;
- owners and modes are changed on the descriptor of what was checked (``fchown``/``fchmod``),
  and never on a file with a second name (a hard link the job made to someone else's file);
- a folder the job renames or swaps while it is worked in stays held by its descriptor: what
  is written lands in the folder that was created, wherever the job moved it, never where a
  link points. A folder can only be moved into a place the job may write to.

Only the result folder itself is named by path: it and the folders above it are the service's.
Reading a job's files (the console's downloads, the logs) is ``jobs.jobfiles``, which keeps the
same rule; ``jobs.services.remove_result_folder`` deletes through descriptors too.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Callable, Collection, Iterator, Sequence

from jobs.jobfiles import MAX_DEPTH, Root, relative_parts

log = logging.getLogger("edt.execution")

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK and O_NOCTTY: whatever sits there is looked at on its descriptor, nothing waits.
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 1 << 20


# What a copy leaves out of a folder: given the folder's path (for messages) and its names.
Skip = Callable[[str, list[str]], Collection[str]]


def _plain(st: os.stat_result) -> bool:
    # A second name may be the job's hard link to a file of the host's.
    return stat.S_ISREG(st.st_mode) and st.st_nlink <= 1


def make_folder(parent_fd: int, name: str, mode: int = 0o777) -> int:
    """A descriptor on the folder ``name`` in the folder ``parent_fd``, made when missing
    (``mode``, less the umask). A link the job put there is removed, not followed; anything
    else in the way (a file, or a link put back at once) fails with ``OSError``."""
    try:
        os.mkdir(name, mode, dir_fd=parent_fd)
    except FileExistsError:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            os.unlink(name, dir_fd=parent_fd)  # removes the link itself
            os.mkdir(name, mode, dir_fd=parent_fd)
    return os.open(name, _DIR, dir_fd=parent_fd)


def make_folders(root: Root, names: Collection[str], mode: int = 0o777) -> None:
    """Make the folders ``names`` directly in the result folder ``root``."""
    root_fd = os.open(root, _DIR)
    try:
        for name in relative_parts(tuple(names)) if names else ():
            os.close(make_folder(root_fd, name, mode))
    finally:
        os.close(root_fd)


def _make_path(root: Root, parts: Sequence[str], mode: int = 0o777) -> int:
    """A descriptor on the folder ``root/parts...``, each made when missing."""
    fd = os.open(root, _DIR)
    try:
        for part in parts:
            sub = make_folder(fd, part, mode)
            os.close(fd)
            fd = sub
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_file(root: Root, parts: Sequence[str], data: bytes, mode: int = 0o644) -> None:
    """Put the file ``root/parts...`` in place with ``data``, making its folders when missing.
    What is there under that name (the job's own file, or a link it planted) is unlinked, not
    opened: the new file is created with ``O_EXCL | O_NOFOLLOW`` in the folder's descriptor,
    so nothing is written through a link or into a file that has another name."""
    *folders, name = relative_parts(parts)
    parent = _make_path(root, folders)
    try:
        try:
            os.unlink(name, dir_fd=parent)
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            raise OSError(errno.EISDIR, f"{name} is a folder") from None
        fd = os.open(name, _NEW, mode, dir_fd=parent)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
    finally:
        os.close(parent)


# --- copying a folder in ---------------------------------------------------------------------


def copy_tree(source: Root, root: Root, parts: Sequence[str],
              skip: Skip | None = None) -> bool:
    """Copy the folder ``source`` to the new folder ``root/parts...``, making the folders on
    the way when missing; False when the copy's folder is there already (nothing is copied
    over it).

    Below ``source`` no link is followed: a link is copied as a link (``symlinkat``, which
    writes nothing through it), only folders and plain files with one name are copied, and
    ``skip(folder, names)`` leaves out names in each folder. The copy is made in folders the
    job cannot enter (``0700``, the caller's), each given its source's mode once complete;
    the caller hands them over. An ``OSError`` leaves a partial copy."""
    *folders, name = relative_parts(parts)
    src = os.open(source, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        parent = _make_path(root, folders)
        try:
            os.mkdir(name, 0o700, dir_fd=parent)
            dst = os.open(name, _DIR, dir_fd=parent)
        except FileExistsError:
            return False
        finally:
            os.close(parent)
        try:
            _copy_folder(src, dst, os.fspath(source), skip, 0)
        finally:
            os.close(dst)
    finally:
        os.close(src)
    return True


def _copy_folder(src: int, dst: int, path: str, skip: Skip | None, depth: int) -> None:
    names = sorted(os.listdir(src))
    left_out = skip(path, names) if skip is not None else ()
    for name in names:
        if name in left_out:
            continue
        st = os.stat(name, dir_fd=src, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(name, dir_fd=src), name, dir_fd=dst)
        elif stat.S_ISREG(st.st_mode):
            _copy_file(src, dst, name)
        elif stat.S_ISDIR(st.st_mode) and depth < MAX_DEPTH:
            _copy_subfolder(src, dst, name, f"{path}/{name}", skip, depth + 1)
    _finish(dst, os.fstat(src))


def _copy_subfolder(src: int, dst: int, name: str, path: str, skip: Skip | None,
                    depth: int) -> None:
    sub_src = os.open(name, _DIR, dir_fd=src)
    try:
        os.mkdir(name, 0o700, dir_fd=dst)
        sub_dst = os.open(name, _DIR, dir_fd=dst)
        try:
            _copy_folder(sub_src, sub_dst, path, skip, depth)
        finally:
            os.close(sub_dst)
    finally:
        os.close(sub_src)


def _copy_file(src: int, dst: int, name: str) -> None:
    fin = os.open(name, _READ, dir_fd=src)
    try:
        st = os.fstat(fin)
        if not _plain(st):
            log.warning("not copied (not a plain file with one name): %s", name)
            return
        fout = os.open(name, _NEW, 0o600, dir_fd=dst)
        try:
            os.set_blocking(fin, True)
            _copy_bytes(fin, fout, st.st_size)
            _finish(fout, st)
        finally:
            os.close(fout)
    finally:
        os.close(fin)


def _copy_bytes(fin: int, fout: int, size: int) -> None:
    """``size`` bytes (the size when opened: a file that grows cannot make it endless)."""
    offset = 0
    while offset < size:
        sent = os.sendfile(fout, fin, offset, min(_CHUNK, size - offset))
        if sent == 0:
            break
        offset += sent


def _finish(fd: int, st: os.stat_result) -> None:
    os.fchmod(fd, stat.S_IMODE(st.st_mode) & 0o777)
    os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))


# --- owners and modes ------------------------------------------------------------------------


def _open_entry(fd: int, entry: os.DirEntry) -> tuple[int, bool] | None:
    """(descriptor, is a folder) for a folder or a plain file with one name; None for a link,
    anything else, or what is gone. The folder's listing says what each entry is (no call):
    only what it calls a folder or a plain file is opened, and checked again on its
    descriptor, so a device, FIFO or socket is never opened."""
    try:
        if entry.is_dir(follow_symlinks=False):
            return os.open(entry.name, _DIR, dir_fd=fd), True
        if not entry.is_file(follow_symlinks=False):
            return None
        leaf = os.open(entry.name, _READ, dir_fd=fd)
    except OSError:
        return None  # a link (ELOOP), no longer a folder (ENOTDIR), or gone
    if _plain(os.fstat(leaf)):
        return leaf, False
    os.close(leaf)
    return None


def _below(fd: int, depth: int = 0) -> Iterator[tuple[int, bool]]:
    """(descriptor, is a folder) for every folder and plain file below the folder ``fd``,
    each folder after what it holds."""
    try:
        with os.scandir(fd) as listing:
            entries = list(listing)
    except OSError:
        return
    for entry in entries:
        opened = _open_entry(fd, entry)
        if opened is None:
            continue
        try:
            if opened[1] and depth < MAX_DEPTH:
                yield from _below(opened[0], depth + 1)
            yield opened
        finally:
            os.close(opened[0])


def change_tree(top: Root, change: Callable[[int, bool], None]) -> None:
    """Call ``change(descriptor, is a folder)`` for everything below the folder ``top`` (links
    and files with a second name left out), then for ``top``: owners and modes are changed on
    what was checked. ``OSError`` from ``change`` is logged and the walk goes on."""
    top_fd = os.open(top, _DIR)
    try:
        for fd, is_folder in _below(top_fd):
            try:
                change(fd, is_folder)
            except OSError as exc:
                log.warning("cannot change an entry below %s: %s", top, exc)
        change(top_fd, True)
    finally:
        os.close(top_fd)



# --- removing --------------------------------------------------------------------------------

# Deeper folders are left and named: each level holds a descriptor open while it is emptied.
REMOVE_DEPTH = 256


def remove_tree(parent_fd: int, name: str, note: Callable[[str, OSError], None],
                path: str = "", depth: int = 0) -> None:
    """Remove ``name`` in the folder ``parent_fd`` and everything below it. A folder is entered
    with ``O_DIRECTORY | O_NOFOLLOW``: a link the job swapped in is removed itself, and what it
    points at is neither removed nor opened (``shutil.rmtree`` removes no more, but opens it
    first: a FIFO there holds it for ever, a device is opened by root). ``note(path, error)``
    hears each entry that could not be removed."""
    path = path or name
    try:
        fd = os.open(name, _DIR, dir_fd=parent_fd)
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ELOOP):  # a file, a link, a FIFO, a device...
            _attempt(note, path, lambda: os.unlink(name, dir_fd=parent_fd))
        else:
            note(path, exc)
        return
    try:
        if depth >= REMOVE_DEPTH:
            note(path, OSError(errno.ELOOP, "folders nested too deep to remove"))
            return
        for entry in _attempt(note, path, lambda: os.listdir(fd)) or ():
            remove_tree(fd, entry, note, f"{path}/{entry}", depth + 1)
    finally:
        os.close(fd)
    _attempt(note, path, lambda: os.rmdir(name, dir_fd=parent_fd))


def _attempt(note: Callable[[str, OSError], None], path: str, step: Callable[[], object]):
    try:
        return step()
    except FileNotFoundError:
        return None
    except OSError as exc:
        note(path, exc)
        return None
