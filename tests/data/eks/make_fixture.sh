#!/usr/bin/env bash
# Writes the .eks golden shards: what the writer wrote before .eks could hold file facts and
# stored target distributions (eaglekit at a5a8c6e, libzstd 1.5.4). tests/formats/test_eks.cpp
# ("eks: shards without facts ...") writes the same records again with the current writer and
# compares every byte, so that a shard without facts or target_probs stays what it was.
#
# Usage: tests/data/eks/make_fixture.sh EAGLEKIT_BIN   (run from the repository root)
#
# Writes, below tests/data/eks/:
#   records/plain/{a,b,c}.pt   ModelOpt-style records (torch.save), bf16, H 8, k 3; no norm form
#                              stated; b has an int32 input_ids and a bool loss mask, c none
#   records/norm/{post,pre}.pt two records that state their norm form (header flag 1)
#   golden/zstd.eks            pack records/plain --block-size 256
#   golden/fp8.eks             the same with --codec fp8
#   golden/norm.eks            pack records/norm --block-size 256
set -euo pipefail
bin=${1:?usage: make_fixture.sh EAGLEKIT_BIN}
out=tests/data/eks
rm -rf "$out/records" "$out/golden"
mkdir -p "$out/records/plain" "$out/records/norm" "$out/golden"
/usr/bin/python3 - "$out/records" <<'PY'
import sys, torch
d = sys.argv[1]
g = torch.Generator().manual_seed(11)
def rec(t, cid, ids=torch.int64, mask=torch.int64, norm=None):
    r = {"input_ids": torch.randint(0, 32, (t,), generator=g).to(ids),
         "hidden_states": torch.randn(t, 8, generator=g).bfloat16(),
         "aux_hidden_states": torch.randn(t, 24, generator=g).bfloat16(),
         "conversation_id": cid}
    if mask is not None:
        r["loss_mask"] = (torch.arange(t) >= t // 3).to(mask)
    if norm is not None:
        r["hidden_states_prenorm"] = norm
    return r
torch.save(rec(5, "a"), d + "/plain/a.pt")
torch.save(rec(40, "b", torch.int32, torch.bool), d + "/plain/b.pt")
torch.save(rec(23, "c", mask=None), d + "/plain/c.pt")
torch.save(rec(9, "post", norm=False), d + "/norm/post.pt")
torch.save(rec(6, "pre", norm=True), d + "/norm/pre.pt")
PY
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$bin" pack "$out/records/plain" --out "$tmp/zstd" --block-size 256 --jobs 1 >/dev/null
"$bin" pack "$out/records/plain" --out "$tmp/fp8" --codec fp8 --block-size 256 --jobs 1 >/dev/null
"$bin" pack "$out/records/norm" --out "$tmp/norm" --block-size 256 --jobs 1 >/dev/null
for k in zstd fp8 norm; do cp "$tmp/$k/shard-000000.eks" "$out/golden/$k.eks"; done
ls -l "$out/golden"
