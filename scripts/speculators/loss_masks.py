"""Writes the loss masks speculators keeps in its prepared dataset folder as one file that
`eaglekit convert --loss-masks FILE` joins to the hs_{i}.safetensors dump.

speculators 0.9 (`speculators prepare-data`) saves its prepared dataset with Hugging Face
datasets' `save_to_disk` (Arrow IPC stream files `data-*.arrow`, `state.json`,
`dataset_info.json`): columns `input_ids` and `loss_mask` (int64 lists) and `seq_len`.
Hidden states go to `hidden_states/hs_{i}.safetensors`, where i is the row of that dataset
(hs_connectors' FileTransfer.get_cached(file_idx)); speculators' trainer
(speculators/train/data.py, ArrowDataset) pairs row i's `loss_mask` with `hs_{i}` and skips
a row whose `input_ids` differ from the file's `token_ids`. eaglekit has no Arrow reader
(Arrow C++ or a flatbuffers parser would be a new dependency for one column), so this
script reads the folder with the same `datasets.load_from_disk` call and rewrites the
column into a safetensors file (written here byte by byte: no torch or numpy needed):

  __metadata__  {"eaglekit": "speculators loss masks", "version": "1", "rows": "N"}
  row_offsets   I64 [N + 1]   row i is [row_offsets[i], row_offsets[i + 1])
  input_ids     I64 [total]   the rows' input_ids, back to back (to check the join)
  loss_mask     U8  [total]   the rows' loss_mask, 0 or 1

Usage (datasets as speculators 0.9 pins it, `datasets>=4.0.0,<=5.1.0`):
  python -m venv .venvs/speculators-masks && .venvs/speculators-masks/bin/pip install datasets==5.1.0
  .venvs/speculators-masks/bin/python scripts/speculators/loss_masks.py PREPARED_DIR OUT.safetensors
"""
import json
import os
import struct
import sys
from array import array

from datasets import load_from_disk


def main(argv):
    if len(argv) != 3:
        sys.exit("usage: loss_masks.py PREPARED_DIR OUT.safetensors")
    src, out = argv[1], argv[2]
    ds = load_from_disk(src)  # as speculators' ArrowDataset does
    for col in ("input_ids", "loss_mask"):
        if col not in ds.column_names:
            sys.exit(f"{src}: no '{col}' column (columns: {ds.column_names}); "
                     "not a speculators prepared dataset")
    offsets, ids, mask = array("q", [0]), array("q"), array("B")
    row = 0
    for batch in ds.with_format("arrow").iter(batch_size=4096):
        for r_ids, r_mask in zip(batch.column("input_ids").to_pylist(),
                                 batch.column("loss_mask").to_pylist()):
            if r_ids is None or r_mask is None or len(r_ids) != len(r_mask):
                sys.exit(f"{src}: row {row}: input_ids has "
                         f"{None if r_ids is None else len(r_ids)} tokens, loss_mask "
                         f"{None if r_mask is None else len(r_mask)}")
            bad = [m for m in r_mask if m not in (0, 1)]
            if bad:
                sys.exit(f"{src}: row {row}: loss_mask holds {bad[0]}, expected 0 or 1")
            ids.extend(r_ids)
            mask.extend(r_mask)
            offsets.append(len(ids))
            row += 1
    if sys.byteorder != "little":
        offsets.byteswap()
        ids.byteswap()
    tensors = [("row_offsets", "I64", offsets), ("input_ids", "I64", ids), ("loss_mask", "U8", mask)]
    header = {"__metadata__": {"eaglekit": "speculators loss masks", "version": "1", "rows": str(row)}}
    pos = 0
    for name, dtype, a in tensors:
        n = len(a) * a.itemsize
        header[name] = {"dtype": dtype, "shape": [len(a)], "data_offsets": [pos, pos + n]}
        pos += n
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    tmp = f"{out}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for _, _, a in tensors:
            f.write(a.tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
    print(f"{out}: {row} rows, {len(ids)} tokens, {sum(mask)} in the loss")


if __name__ == "__main__":
    main(sys.argv)
