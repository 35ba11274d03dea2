"""Files that another user could forge are never trusted (OpenSSH's ``StrictModes``, applied to the deployment).

The services file names the addresses that get the deployment's secrets and the CA that proves a server is
the deployment's; the secret files hold the password, the token and the cache key; the state folder holds
both. A file another local user can write (or a folder where they can replace it) would let them name their
own listeners and CA, and collect the secrets. So, before any of them is used:

* the file must be owned by this user or by root, and writable by neither group nor others;
* a secret file (or a private key) must not be readable by them either, with one exception: a file of root's
  that root made readable to a group of this (non-root) process and to nobody else, as the kubelet mounts a
  Secret volume for a pod with ``fsGroup`` (``root:<fsGroup>``, mode 0440): only root chose who may read it;
* every folder above it must be owned by this user or by root, and not writable by group or others unless
  it is sticky (``/tmp``: others may add entries there, but may not rename or delete ours).

A violation raises :class:`UntrustedFileError`, one line naming the path, its owner, its mode and the fix.
The owner and mode checked are those of the file actually opened (``fstat`` on the open descriptor), so a
file swapped between the check and the read is not read in its place.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .errors import ConfigurationError

_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
_OTHERS_ANY = stat.S_IRWXG | stat.S_IRWXO


class UntrustedFileError(ConfigurationError):
    """A file or folder of the deployment is owned or writable (a secret: readable) by another user."""


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def _trusted_owner(uid: int) -> bool:
    return uid in (os.geteuid(), 0)


def _me() -> str:
    return _owner(os.geteuid())


def check_stat(path: str | Path, st: os.stat_result, what: str, *, secret: bool = False) -> None:
    """Refuse ``path`` (a ``what``: "services file", "secret file", ...) whose status is ``st`` unless this user
    or root owns it and others cannot write it (with ``secret``: nor read it).

    Raises:
        UntrustedFileError: naming the path, its owner and mode, and the fix.
    """
    mode = stat.S_IMODE(st.st_mode)
    where = f"{what} {path} is owned by {_owner(st.st_uid)} with mode {mode:04o}"
    if not _trusted_owner(st.st_uid):
        raise UntrustedFileError(
            f"{where}: only files of {_me()} or root are trusted, as another user could have planted it; "
            f"remove it (`rm -r {path}`, as root where need be) and run `bagua-lightning up` again.")
    if secret and _group_readable_by_roots_choice(st):
        return
    if mode & (_OTHERS_ANY if secret else _OTHERS_WRITE):
        fix = f"chmod go-rwx {path}" if secret else f"chmod go-w {path}"
        kind = "read or written" if secret else "written"
        raise UntrustedFileError(f"{where}: it can be {kind} by other users, so it is not trusted; "
                                 f"run `{fix}` if its content is yours, else remove it.")


def _group_readable_by_roots_choice(st: os.stat_result) -> bool:
    """A secret of root's, readable (only read) by its group and that group one of this process's, which is not
    root's: how Kubernetes gives a non-root pod a Secret volume (files ``root:<fsGroup>``, mode 0440;
    ``defaultMode`` 0400 becomes 0440 there). Nobody but root could have made it so, and root reads every file
    anyway; root's own process is refused as before (its file: it can ``chmod go-rwx``)."""
    mode = stat.S_IMODE(st.st_mode)
    return (st.st_uid == 0 and os.geteuid() != 0 and mode & _OTHERS_ANY == stat.S_IRGRP
            and (st.st_gid == os.getegid() or st.st_gid in os.getgroups()))


def check_folders(path: str | Path, what: str) -> None:
    """Refuse ``path`` when a folder above it (its real path's) is another user's or writable by others
    without the sticky bit, so that someone else could replace it.

    Raises:
        UntrustedFileError: naming the folder, its owner and mode, and the fix.
    """
    real = Path(os.path.realpath(path))
    for folder in real.parents:
        try:
            st = os.stat(folder)
        except OSError:
            continue  # not there (yet): nothing in it to replace
        mode = stat.S_IMODE(st.st_mode)
        sticky = bool(mode & stat.S_ISVTX)
        if not _trusted_owner(st.st_uid) or (mode & _OTHERS_WRITE and not sticky):
            raise UntrustedFileError(
                f"{what} {path} lies in {folder}, owned by {_owner(st.st_uid)} with mode {mode:04o}: another user "
                f"could replace what is in it, so it is not trusted; keep the state in a folder of {_me()} "
                "that others cannot write (`chmod go-w` it, or set XDG_STATE_HOME / "
                "BAGUA_LIGHTNING_SERVICES_FILE elsewhere).")


def read_trusted(path: str | Path, what: str, *, secret: bool = False) -> str:
    """The text of ``path`` after :func:`check_folders` and :func:`check_stat` of the file opened.

    Raises:
        FileNotFoundError, OSError: as ``open`` (the caller names the file).
        UntrustedFileError: the file or a folder above it could have been forged.
    """
    check_folders(path, what)
    with open(path, "rb") as handle:
        check_stat(path, os.fstat(handle.fileno()), what, secret=secret)
        data = handle.read()
    return data.decode()


def check_trusted(path: str | Path, what: str, *, secret: bool = False) -> None:
    """:func:`read_trusted`'s checks without reading: for a file another program opens (a CA, a key) or that
    is about to be made (a lock). A missing file in trusted folders passes (whoever opens it reports it)."""
    check_folders(path, what)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    check_stat(path, st, what, secret=secret)


def check_own_folder(path: str | Path, what: str = "state folder") -> None:
    """Refuse to adopt the existing folder ``path`` unless this very user owns it (``up`` makes it 0700 and keeps
    its secrets there), and unless the folders above it are trusted (:func:`check_folders`)."""
    check_folders(path, what)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        st = os.stat(path)
    if st.st_uid != os.geteuid():
        raise UntrustedFileError(
            f"{what} {path} is owned by {_owner(st.st_uid)} with mode {stat.S_IMODE(st.st_mode):04o}, not by "
            f"{_me()}: `up` does not adopt a folder another user made (they could read the secrets kept there); "
            f"remove it (`rm -r {path}`, as root where need be) or set XDG_STATE_HOME to a folder of yours.")
