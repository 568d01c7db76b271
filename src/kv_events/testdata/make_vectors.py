"""Test vectors of vLLM's KV cache event wire format (issue 20).

vLLM publishes `EventBatch`es of `BlockStored` / `BlockRemoved` /
`AllBlocksCleared` events, encoded by msgspec's msgpack encoder. The struct
definitions below restate the layouts of `vllm/distributed/kv_events.py`
as its releases have shipped them (field names, order, defaults and the
msgspec options that decide the encoding), so the vectors are what those
engines put on the wire:

* `legacy`: batch and events `array_like` (positional arrays; an event's
  first element is its tag, the class name), hashes ints, no `lora_name`;
* `tagged`: batch `array_like`, events maps with a `"type"` tag, hashes
  bytes or ints, `lora_name`, `extra_keys` (omitted while `None`);
* `maps`: batch a map too, events with `group_idx` and the cache-spec
  fields.

Run with msgspec installed (`pip install msgspec`):

    python3 make_vectors.py

It writes `<name>.msgpack` (the payload frame) and `<name>.json` (what a
decoder must read from it, hashes as ints or `"hex:..."` strings) for each
vector. The vectors are committed; CI does not need msgspec.
"""

import json
import pathlib

import msgspec

HERE = pathlib.Path(__file__).parent


def layouts(batch_array, event_array, extra_fields):
    """The structs of one generation."""

    class EventBatch(msgspec.Struct, array_like=batch_array, omit_defaults=True, gc=False):
        ts: float
        events: list
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, array_like=event_array, omit_defaults=True, gc=False, tag=True):
        pass

    if extra_fields == "legacy":

        class BlockStored(KVCacheEvent):
            block_hashes: list[int]
            parent_block_hash: int | None
            token_ids: list[int]
            block_size: int
            lora_id: int | None
            medium: str | None

        class BlockRemoved(KVCacheEvent):
            block_hashes: list[int]
            medium: str | None

    elif extra_fields == "tagged":

        class BlockStored(KVCacheEvent):
            block_hashes: list[bytes | int]
            parent_block_hash: bytes | int | None
            token_ids: list[int]
            block_size: int
            lora_id: int | None
            medium: str | None
            lora_name: str | None
            extra_keys: list | None = None

        class BlockRemoved(KVCacheEvent):
            block_hashes: list[bytes | int]
            medium: str | None

    else:

        class BlockStored(KVCacheEvent):
            block_hashes: list[bytes | int]
            parent_block_hash: bytes | int | None
            token_ids: list[int]
            block_size: int
            lora_id: int | None
            medium: str | None
            lora_name: str | None
            extra_keys: list | None = None
            group_idx: int | None = None
            kv_cache_spec_kind: str | None = None
            kv_cache_spec_sliding_window: int | None = None

        class BlockRemoved(KVCacheEvent):
            block_hashes: list[bytes | int]
            medium: str | None
            group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    return EventBatch, BlockStored, BlockRemoved, AllBlocksCleared


def hash_json(h):
    if h is None:
        return None
    if isinstance(h, bytes):
        return "hex:" + h.hex()
    return h


def expected(batch):
    events = []
    for e in batch.events:
        name = type(e).__name__
        if name == "BlockStored":
            events.append(
                {
                    "kind": "stored",
                    "block_hashes": [hash_json(h) for h in e.block_hashes],
                    "parent": hash_json(e.parent_block_hash),
                    "token_ids": e.token_ids,
                    "block_size": e.block_size,
                    "lora_id": e.lora_id,
                    "lora_name": getattr(e, "lora_name", None),
                    "medium": e.medium,
                    "group": getattr(e, "group_idx", None),
                }
            )
        elif name == "BlockRemoved":
            events.append(
                {
                    "kind": "removed",
                    "block_hashes": [hash_json(h) for h in e.block_hashes],
                    "medium": e.medium,
                    "group": getattr(e, "group_idx", None),
                }
            )
        else:
            events.append({"kind": "cleared"})
    return {"ts": batch.ts, "data_parallel_rank": batch.data_parallel_rank, "events": events}


def write(name, batch):
    payload = msgspec.msgpack.encode(batch)
    (HERE / f"{name}.msgpack").write_bytes(payload)
    (HERE / f"{name}.json").write_text(json.dumps(expected(batch), indent=1) + "\n")


def sha(i):
    """A 32-byte block hash as vLLM's sha256 hashing gives one."""
    return bytes((i * 37 + k * 11) % 256 for k in range(32))


def main():
    tokens = list(range(100, 132))
    # legacy: ints, some negative (Python's hash()), the largest unsigned.
    B, S, R, C = layouts(True, True, "legacy")
    write(
        "legacy",
        B(
            ts=1732000000.25,
            events=[
                S([-5, 2**63 - 1], None, tokens, 16, None, "GPU"),
                S([2**64 - 1], 2**63 - 1, tokens[:16], 16, 3, None),
                R([-5], "GPU"),
                C(),
            ],
        ),
    )
    write("legacy_dp", B(ts=7.5, events=[R([1, 2, 3], "CPU")], data_parallel_rank=2))
    # tagged: bytes (sha256) hashes, a LoRA adapter, extra keys.
    B, S, R, C = layouts(True, False, "tagged")
    write(
        "tagged",
        B(
            ts=1732000001.5,
            events=[
                S([sha(1), sha(2)], None, tokens, 16, None, "GPU", None),
                S([sha(3)], sha(2), tokens[:16], 16, 1, "GPU", "sql-adapter", [None]),
                R([sha(1), sha(2)], "GPU"),
                C(),
            ],
            data_parallel_rank=1,
        ),
    )
    # maps: the whole batch a map, group indices.
    B, S, R, C = layouts(False, False, "maps")
    write(
        "maps",
        B(
            ts=1732000002.0,
            events=[
                S([sha(4)], None, tokens[:16], 16, None, "GPU", None, group_idx=0, kv_cache_spec_kind="full_attention"),
                R([sha(4)], "GPU", group_idx=0),
                C(),
            ],
        ),
    )


if __name__ == "__main__":
    main()
