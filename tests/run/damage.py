"""Damage done to an orbax checkpoint folder on disk, as a failing disk or a killed copy would."""


def truncate_largest_data_file(folder) -> None:
    """Cuts the largest TensorStore data file of checkpoint `folder` to half its length."""
    data = max(
        (p for p in (folder / "default").rglob("*") if p.is_file() and p.parent.name == "d"),
        key=lambda p: p.stat().st_size,
    )
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])


def empty_metadata(folder) -> None:
    """Empties the `_METADATA` file (the tree structure) of checkpoint `folder`."""
    (folder / "default" / "_METADATA").write_text("")
