#!/usr/bin/env bash
# Runs `sparsemla inspect` on every malformed file of this folder. Each must be refused: exit
# status 1 (not a crash or a signal, not 0), and a message that contains the text of its .expect
# file. No two files may give the same message. Regenerate with scripts/make_malformed_corpus.py.
set -u
bin=$1
dir=$2
fail=0
n=0
declare -A seen
for expect in "$dir"/*.expect; do
  target=$(sed -n 1p "$expect")
  want=$(sed -n 2p "$expect")
  msg=$(timeout 20 "$bin" inspect "$dir/$target" 2>&1 >/dev/null)
  rc=$?
  n=$((n + 1))
  if [ $rc -ne 1 ]; then
    echo "FAIL $target: exit status $rc (expected 1): $msg"
    fail=$((fail + 1))
  elif [[ "$msg" != *"$want"* ]]; then
    echo "FAIL $target: message does not contain '$want': $msg"
    fail=$((fail + 1))
  elif [ -n "${seen[$msg]+x}" ]; then
    echo "FAIL $target: same message as ${seen[$msg]}: $msg"
    fail=$((fail + 1))
  else
    seen[$msg]=$target
    echo "ok   $target: $msg"
  fi
done
echo "$((n - fail)) passed, $fail failed"
[ $fail -eq 0 ] && [ $n -gt 0 ]
