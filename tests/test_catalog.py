"""The GGUF conversion cache is keyed by content: files that share a name and size never share a conversion,
a byte-identical copy reuses it, and a file rewritten in place is converted again."""

from __future__ import annotations

import json
import os
import shutil

from tuichat import catalog


def gguf(path, content: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


def converted_dir(path):
    return catalog.resolve(str(path)).converted_dir


def test_same_name_and_size_but_other_bytes_never_share_a_conversion(tmp_path):
    first = gguf(tmp_path / "a" / "model.gguf", b"GGUF" + b"\1" * 4092)
    second = gguf(tmp_path / "b" / "model.gguf", b"GGUF" + b"\2" * 4092)
    assert converted_dir(first) != converted_dir(second)
    # The same bytes elsewhere, under any name, are the same model.
    copy = tmp_path / "c" / "renamed.gguf"
    copy.parent.mkdir()
    shutil.copyfile(first, copy)
    assert converted_dir(copy) == converted_dir(first)
    assert converted_dir(first).parent == catalog.converted_root()


def test_a_file_rewritten_in_place_gets_a_new_key(tmp_path):
    path = gguf(tmp_path / "model.gguf", b"GGUF" + b"\1" * 4092)
    before = converted_dir(path)
    stat = path.stat()
    path.write_bytes(b"GGUF" + b"\2" * 4092)  # same size
    # Put the old mtime back: a later load only stats the file, so it keeps the key it remembered...
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert converted_dir(path) == before
    # ...and a new mtime, as any real write gives (set here, as a write in the same clock tick would not),
    # has it read again.
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    rewritten = converted_dir(path)
    assert rewritten != before
    path.write_bytes(b"GGUF" + b"\2" * 5000)  # a new size is enough
    assert converted_dir(path) not in (before, rewritten)


def test_a_damaged_index_is_started_again(tmp_path):
    path = gguf(tmp_path / "model.gguf", b"GGUF" + b"\1" * 4092)
    expected = converted_dir(path)
    stat = path.stat()
    not_a_hash = json.dumps({str(path): [stat.st_size, stat.st_mtime_ns, "../../elsewhere"]})
    for damage in ("{not json", "[1, 2]", f'{{"{path}": 3}}', not_a_hash):
        (catalog.converted_root() / "hashes.json").write_text(damage)
        assert converted_dir(path) == expected


def test_a_copy_of_a_converted_gguf_uses_that_conversion(embedded, tmp_path):
    """End to end: a renamed copy of the embedded model loads its conversion, and converts nothing."""
    from tuichat.engine import loader

    resolved, *_ = embedded
    copy = tmp_path / "elsewhere" / "model.gguf"
    copy.parent.mkdir()
    shutil.copyfile(resolved.source, copy)
    model = catalog.resolve(str(copy))
    assert model.converted_dir == resolved.converted_dir
    stages = []
    assert loader.converted_path(model, lambda *stage: stages.append(stage)) == resolved.converted_dir
    assert stages == []
