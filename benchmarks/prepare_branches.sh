#!/usr/bin/env bash
# Run here (not on the device): experiment branches for the device suites' BRANCHES option.
#   bash benchmarks/prepare_branches.sh REF [REF ...]
# For each REF, the changes of its own commits (`git diff HEAD...REF`, library and benchmark
# files) are applied onto HEAD in a scratch worktree, and the files they add or change are
# written to .variants/<REF with / as _>/<path> (ignored by git: pass carry=[".variants"] to the
# device call; benchmarks/device/prelude.sh says how a suite runs them). A REF whose changes do
# not apply onto HEAD, or that deletes files (a version can only replace or add them), is refused.
# A REF may also be a saved patch, benchmarks/pending/NAME.patch (`git diff main...BRANCH --
# liquidcp_jax benchmarks` of a branch its session could not time): the version is then NAME.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 REF [REF ...]" >&2; exit 2; }
root=$(git rev-parse --show-toplevel); cd "$root"
tmp=
trap '[ -z "$tmp" ] || git worktree remove --force "$tmp" 2>/dev/null || true' EXIT
for ref in "$@"; do
  if [[ "$ref" == *.patch ]]; then   # a saved patch (benchmarks/pending/)
    [ -f "$ref" ] || { echo "$ref: no such patch" >&2; exit 2; }
    name=$(basename "$ref" .patch)
    patch=$(cat "$ref")
    gone=$(printf '%s\n' "$patch" | awk '/^diff --git /{f=$4; sub("^b/", "", f)} /^deleted file mode/{print f}')
  else
    git rev-parse -q --verify "$ref^{commit}" >/dev/null || { echo "$ref: not a commit" >&2; exit 2; }
    name=${ref//\//_}
    patch=$(git diff --binary "HEAD...$ref" -- liquidcp_jax benchmarks)
    gone=$(git diff --name-only --diff-filter=D "HEAD...$ref" -- liquidcp_jax benchmarks)
  fi
  [ -n "$patch" ] || { echo "$ref: changes nothing under liquidcp_jax/ or benchmarks/" >&2; exit 1; }
  [ -z "$gone" ] || { echo "$ref: deletes $gone; a version can only replace or add files" >&2; exit 1; }
  tmp=$(mktemp -d)
  git worktree add -q --detach "$tmp" HEAD
  (cd "$tmp" && printf '%s\n' "$patch" | git apply --index --3way 2>&1) ||
    { echo "$ref: its changes do not apply onto HEAD (rebase it)" >&2; exit 1; }
  files=$(cd "$tmp" && git diff --cached --name-only)
  rm -rf ".variants/$name"
  for f in $files; do mkdir -p ".variants/$name/$(dirname "$f")"; cp "$tmp/$f" ".variants/$name/$f"; done
  git worktree remove --force "$tmp"; tmp=
  echo "$name: $(echo $files | wc -w) file(s): $files"
done
