"""Helpers to look at a release store from the outside, whichever kind it is."""

from __future__ import annotations

from infra.rollout.releases import ReleaseStore


def snapshot(store: ReleaseStore) -> dict[str, bytes]:
    """Every object of the store, by key: to show that a refused command changed nothing."""
    objects = store.objects
    return {key: objects.read(key)[0] for prefix in ("", "revisions/", "audit/") for key in objects.list(prefix)}
