#!/usr/bin/env bash
# Run here (not on the device): experiment branches for the device suites' BRANCHES option.
#   bash benchmarks/prepare_branches.sh REF [REF ...]
# For each REF, the changes of its own commits (`git diff HEAD...REF`, library and benchmark
# files) are applied onto HEAD in a scratch worktree, and the files they touch are written to
# .variants/<REF with / as _>/<path> (ignored by git: pass carry=[".variants"] to the device
# call; benchmarks/device/prelude.sh says how a suite runs them). A REF whose changes do not apply
# onto HEAD is refused (rebase it first).
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 REF [REF ...]" >&2; exit 2; }
root=$(git rev-parse --show-toplevel); cd "$root"
for ref in "$@"; do
  git rev-parse -q --verify "$ref^{commit}" >/dev/null || { echo "$ref: not a commit" >&2; exit 2; }
  name=${ref//\//_}
  tmp=$(mktemp -d)
  git worktree add -q --detach "$tmp" HEAD
  if ! (cd "$tmp" && git diff "HEAD...$ref" -- liquidcp_jax benchmarks | git apply --index --3way 2>&1); then
    git worktree remove --force "$tmp"; echo "$ref: its changes do not apply onto HEAD" >&2; exit 1
  fi
  files=$(cd "$tmp" && git diff --cached --name-only)
  rm -rf ".variants/$name"
  for f in $files; do mkdir -p ".variants/$name/$(dirname "$f")"; cp "$tmp/$f" ".variants/$name/$f"; done
  git worktree remove --force "$tmp"
  echo "$name: $(echo $files | wc -w) file(s): $files"
done
