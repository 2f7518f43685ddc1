"""The table of models the broker logs once its loads at start are over, in Triton's form (its
``server.cc`` prints one): what serves and what failed, with why, in one place an operator
finds without reading every load's lines or asking the repository index."""
from __future__ import annotations

from .catalog import Catalog


def model_rows(catalog: Catalog) -> list[tuple[str, str, str]]:
    """(model, version, status) of every model loaded or tried, by name and version; a failure's
    status is UNAVAILABLE and its reason, as the index gives it."""
    rows = []
    for name in sorted(set(catalog.models) | set(catalog.load_errors)):
        versions = catalog.models.get(name, {})
        failed = catalog.load_errors.get(name)
        if failed is not None:
            failed = " ".join(failed.split())  # (one line a row: a reason may span several)
        for version in sorted(versions):
            status = versions[version].state.value
            rows.append((name, str(version), status if failed is None else
                         f"{status} (the last load failed: {failed})"))
        if failed is not None and not versions:
            tried = catalog.failed_versions.get(name) or {"-": failed}
            rows += [(name, str(v), f"UNAVAILABLE: {' '.join(why.split())}") for v, why in tried.items()]
    return rows


def table(rows: list[tuple[str, str, str]]) -> str:
    """``rows`` under a Model, Version, Status head, in Triton's borders."""
    head = ("Model", "Version", "Status")
    widths = [max(len(r[k]) for r in [head, *rows]) for k in range(3)]
    border = "+" + "+".join("-" * (w + 2) for w in widths) + "+"

    def line(r: tuple[str, str, str]) -> str:
        return "|" + "|".join(f" {cell:<{w}} " for cell, w in zip(r, widths)) + "|"

    return "\n".join([border, line(head), border, *(line(r) for r in rows), border])
