import io
import tarfile
import zipfile

import pytest
from django.core.exceptions import ValidationError

from datasets import services
from datasets.archives import extract_archive
from datasets.models import Dataset
from datasets.paths import confine

pytestmark = pytest.mark.django_db


def test_it_accepts_a_folder_inside_a_root(roots):
    folder = roots["alice"] / "cifar" / "train_db"
    assert confine(str(folder), [roots["data"]]) == folder


def test_it_resolves_relative_paths_against_the_first_root(roots):
    assert confine("alice/cifar/test_db", [roots["data"]]) == roots["alice"] / "cifar" / "test_db"


@pytest.mark.parametrize("path", ["../etc", "cifar/../../x", "/etc", "", "  "])
def test_it_refuses_paths_outside_the_roots(roots, path):
    with pytest.raises(ValidationError):
        confine(path, [roots["data"]])


def test_it_refuses_a_symlink_that_escapes(roots):
    (roots["data"] / "escape").symlink_to("/etc")
    with pytest.raises(ValidationError, match="outside the allowed data roots"):
        confine(str(roots["data"] / "escape"), [roots["data"]])


def test_it_refuses_a_missing_folder(roots):
    with pytest.raises(ValidationError, match="not an existing folder"):
        confine(str(roots["data"] / "nope"), [roots["data"]])


def test_create_names_the_field_at_fault(roots, owner):
    with pytest.raises(ValidationError) as err:
        services.dataset_create(
            owner=owner,
            name="d",
            train_path=str(roots["alice"] / "cifar" / "train_db"),
            test_path="../../etc",
        )
    assert set(err.value.message_dict) == {"test_path"}
    assert Dataset.objects.count() == 0


def test_names_are_unique(dataset, owner, roots):
    with pytest.raises(ValidationError, match="already have"):
        services.dataset_create(
            owner=owner, name=dataset.name, train_path="cifar/train_db", test_path="cifar/test_db"
        )


def _zip(members: dict[str, bytes]) -> io.BytesIO:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    buf.seek(0)
    return buf


def _tar(members: dict[str, bytes], link: tuple[str, str] | None = None) -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
        if link:
            info = tarfile.TarInfo(link[0])
            info.type = tarfile.SYMTYPE
            info.linkname = link[1]
            archive.addfile(info)
    buf.seek(0)
    return buf


def test_an_uploaded_archive_becomes_a_dataset(roots, owner):
    archive = _tar({"cifar/train_db/a.bin": b"1", "cifar/test_db/b.bin": b"2"})
    ds = services.dataset_create_from_archive(owner=owner, name="up", archive=archive)
    assert ds.uploaded
    assert ds.train_path.endswith("train_db") and ds.test_path.endswith("test_db")


@pytest.mark.parametrize(
    "archive, message",
    [
        (_zip({"../evil.txt": b"x"}), "outside the folder"),
        (_zip({"/abs.txt": b"x"}), "outside the folder"),
        (_tar({"train/a": b"x"}, link=("train/l", "/etc/passwd")), "is a link"),
        (io.BytesIO(b"this is not an archive"), "not a zip, tar or tar.gz"),
    ],
)
def test_bad_archives_are_refused_and_nothing_is_written(roots, owner, archive, message):
    with pytest.raises(ValidationError, match=message):
        services.dataset_create_from_archive(owner=owner, name="bad", archive=archive)
    assert Dataset.objects.count() == 0
    uploads = roots["tmp"] / "uploads" / "datasets"
    assert not uploads.exists() or not any(uploads.iterdir())


def test_an_archive_larger_than_the_limit_is_refused(tmp_path):
    archive = _zip({"train/big.bin": b"0" * 2048})
    with pytest.raises(ValidationError, match="expands to more than 1024 bytes"):
        extract_archive(archive, tmp_path / "out", max_bytes=1024)
    assert not (tmp_path / "out").exists()
