"""Tiered residency of routed experts: pack files on disk, host stores, the device cache and replay (docs/STORE.md)."""

from moet.store.cache import CacheTooSmall, ExpertCache
from moet.store.layout import RowLayout
from moet.store.pack import Pack, PackWriter, build_pack, open_pack
from moet.store.replay import ReplayDriver, ReplayError
from moet.store.stores import ArenaStore, ExpertStore, PackStore, PinnedStore, open_store

__all__ = [
    "ArenaStore",
    "CacheTooSmall",
    "ExpertCache",
    "ExpertStore",
    "Pack",
    "PackStore",
    "PackWriter",
    "PinnedStore",
    "ReplayDriver",
    "ReplayError",
    "RowLayout",
    "build_pack",
    "open_pack",
    "open_store",
]
