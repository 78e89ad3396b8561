"""ModelRepository alone (no gRPC): what it serves as an operator adds, breaks, deletes and
republishes version directories. Each test drives ``refresh()`` itself; a poll is one call."""
from recserve.manifest import MAX_VERSION, list_versions, scan_versions

TOO_BIG = str(MAX_VERSION + 1)  # 9223372036854775808: an int64 overflow on the wire


# -- Source: version names ------------------------------------------------------------------------

def test_only_ascii_numbers_from_1_to_max_are_versions(tmp_path):
    for name in ["1", str(MAX_VERSION), "²", "0", "007", "v2", TOO_BIG, ".3.incoming"]:
        (tmp_path / name).mkdir()
    (tmp_path / "README").write_text("plain files are neither")
    listing = scan_versions(tmp_path)
    assert listing.versions == [1, MAX_VERSION]
    assert listing.not_versions == sorted(["²", "0", "007", "v2", TOO_BIG])
    assert list_versions(tmp_path) == [1, MAX_VERSION]
    assert list_versions(tmp_path / "absent") == []
