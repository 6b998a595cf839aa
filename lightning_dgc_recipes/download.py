"""Download helpers shared by the DataModules: fetch a file, check its MD5, unpack an archive.

Kept in plain ``urllib`` so that downloading needs nothing beyond the standard library, and every
failure ends in a :class:`DatasetNotFoundError` that says where to put the files by hand: the
recipes must be usable on machines without internet access.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
import urllib.error
import urllib.request
from pathlib import Path

__all__ = ["DatasetNotFoundError", "check_md5", "download_file", "extract_tar"]

_CHUNK = 1 << 20


class DatasetNotFoundError(FileNotFoundError):
    """The dataset is neither on disk nor downloadable; the message says where to put it."""


def check_md5(path: str | os.PathLike[str], md5: str) -> bool:
    """Return whether the file at ``path`` has the hexadecimal MD5 digest ``md5``."""
    digest = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest() == md5


def download_file(
    url: str, destination: str | os.PathLike[str], md5: str | None, hint: str, timeout: float = 60.0
) -> Path:
    """Download ``url`` to ``destination`` and verify its MD5; reuse an existing file that verifies.

    The file is written under a temporary name and renamed only once complete and verified, so an
    interrupted download never leaves a truncated file that looks valid.

    Args:
        url: where to fetch the file from.
        destination: the file to create (its folder is created if needed).
        md5: expected hexadecimal MD5 digest, or ``None`` to skip the check.
        hint: a sentence for the error message telling the user where to put the files by hand.
        timeout: seconds to wait for the server before giving up.

    Raises:
        DatasetNotFoundError: the server could not be reached, or the file does not match ``md5``.
    """
    destination = Path(destination)
    if destination.is_file() and (md5 is None or check_md5(destination, md5)):
        return destination
    destination.parent.mkdir(parents=True, exist_ok=True)
    partial = destination.with_name(destination.name + ".part")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response, open(partial, "wb") as out:
            shutil.copyfileobj(response, out, _CHUNK)
    except (urllib.error.URLError, OSError) as error:
        partial.unlink(missing_ok=True)
        raise DatasetNotFoundError(f"Could not download {url} ({error}). {hint}") from error
    if md5 is not None and not check_md5(partial, md5):
        partial.unlink(missing_ok=True)
        raise DatasetNotFoundError(f"The file downloaded from {url} does not have the MD5 {md5}. {hint}")
    partial.replace(destination)
    return destination


def extract_tar(archive: str | os.PathLike[str], destination: str | os.PathLike[str]) -> None:
    """Unpack a (compressed) tar archive into ``destination``, refusing members that escape it."""
    with tarfile.open(archive) as tar:
        if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12 / 3.11.4: safe extraction built in
            tar.extractall(destination, filter="data")
        else:  # pragma: no cover - older interpreters
            root = Path(destination).resolve()
            for member in tar.getmembers():
                if not (root / member.name).resolve().is_relative_to(root):
                    raise DatasetNotFoundError(f"Refusing to extract {member.name!r} outside {root}.")
            tar.extractall(destination)
