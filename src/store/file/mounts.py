"""Which file system a directory is on, and whether a call into it may hang (``file://``'s deadline).

A read or write on a local file system (tmpfs, ext4, xfs, ...) returns: it may fail, never block for good.
On a network or FUSE file system (NFS, CIFS, 9p, Ceph, Lustre, sshfs, ...) a call blocks for as long as the
server or the daemon does not answer -- with a ``hard`` NFS mount, forever. ``file://`` runs its calls under
a deadline of its own on every file system that is not known to be local (see ``hybridkv.store.file``).

Linux only: the file system comes from ``/proc/self/mountinfo`` (the mount that holds the directory, after
symlinks are resolved). Where that cannot be read, the type is ``unknown``, which may hang.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

#: File systems whose calls return (they may fail, never block for good). Everything else may hang:
#: network file systems (nfs, nfs4, cifs, smb3, smbfs, 9p, ceph, glusterfs, lustre, gpfs, ...), every FUSE
#: file system (``fuse``, ``fuseblk``, ``fuse.sshfs``, ...: a stuck daemon blocks its callers), autofs
#: before it mounted, and any type this list does not know.
LOCAL_FSTYPES = frozenset(
    {
        "tmpfs",
        "ramfs",
        "hugetlbfs",
        "devtmpfs",
        "ext2",
        "ext3",
        "ext4",
        "xfs",
        "btrfs",
        "bcachefs",
        "zfs",
        "f2fs",
        "jfs",
        "reiserfs",
        "nilfs2",
        "overlay",
        "squashfs",
        "erofs",
        "iso9660",
        "udf",
        "vfat",
        "exfat",
        "ntfs3",
        "hfsplus",
    }
)
#: The type of a directory whose mount could not be found (no ``/proc/self/mountinfo``).
UNKNOWN_FSTYPE = "unknown"
MOUNTINFO_PATH = "/proc/self/mountinfo"

_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True)
class Mount:
    """One line of mountinfo, the parts that matter here."""

    mount_point: str
    fstype: str
    source: str


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts in ``text`` (the format of ``/proc/self/mountinfo``, see proc(5)), in listed order.

    A line is ``ID PARENT MAJ:MIN ROOT MOUNT_POINT OPTIONS [OPTIONAL FIELDS...] - FSTYPE SOURCE SUPER_OPTIONS``;
    the optional fields are variable in number, so the type is found after the lone ``-``. Octal escapes in
    the mount point (``\\040`` for a space) are decoded. Lines that do not fit are skipped.
    """
    mounts: list[Mount] = []
    for line in text.splitlines():
        fields = line.split(" ")
        try:
            separator = fields.index("-", 6)
        except ValueError:
            continue
        if len(fields) < separator + 3:
            continue
        mount_point = _OCTAL_ESCAPE.sub(lambda match: chr(int(match.group(1), 8)), fields[4])
        mounts.append(Mount(mount_point, fields[separator + 1], fields[separator + 2]))
    return mounts


def mount_of(path: str, mounts: list[Mount]) -> Mount | None:
    """The mount that holds the absolute, symlink-free ``path``: the one with the longest mount point that
    is ``path`` or one of its parents; of several on the same mount point, the last listed (mounted on top
    of the others). ``None`` if no mount holds it."""
    assert os.path.isabs(path), f"mount_of needs an absolute path, got {path!r}"
    found: Mount | None = None
    for mount in mounts:
        point = mount.mount_point
        holds = point in ("/", path) or path.startswith(point.rstrip("/") + "/")
        if holds and (found is None or len(point) >= len(found.mount_point)):
            found = mount
    return found


def may_hang(fstype: str) -> bool:
    """Whether a call into a file system of type ``fstype`` may block without ever returning."""
    return fstype not in LOCAL_FSTYPES


def directory_fstype(directory: str, mountinfo_path: str = MOUNTINFO_PATH) -> str:
    """The type of the file system holding the existing ``directory`` (symlinks resolved), or
    ``UNKNOWN_FSTYPE`` when mountinfo cannot be read or lists no mount that holds it."""
    try:
        with open(mountinfo_path, encoding="utf-8", errors="surrogateescape") as file:
            text = file.read()
    except OSError:
        return UNKNOWN_FSTYPE
    mount = mount_of(os.path.realpath(directory), parse_mountinfo(text))
    return UNKNOWN_FSTYPE if mount is None else mount.fstype
