#!/usr/bin/env bash
# framework/version_commit.cmake on made-up trees (CTest runs this; about a second): a git work tree
# gives its commit's short hash, "-dirty" once a tracked file changes (an untracked file does not
# count), "unknown" for a directory outside git (a source archive) and for a subdirectory of another
# repository; the header is rewritten only when its text changes. Then `carry --version` prints the
# commit the build wrote. Usage: version_commit_test.sh SOURCE_DIR BUILD_DIR
set -u
src=$1 build=$2
script=$src/framework/version_commit.cmake
tmp=$(mktemp -d /tmp/carry_version_commit.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
failed=0

commit_of() {  # the CARRY_GIT_COMMIT the script writes for source dir $1 into header $2
  cmake -DSOURCE_DIR="$1" -DOUT="$2" -P "$script" >/dev/null || { echo "FAIL: the script failed on $1"; failed=1; }
  sed -n 's/^#define CARRY_GIT_COMMIT "\(.*\)"$/\1/p' "$2"
}
expect() {  # name got want
  if [ "$2" = "$3" ]; then echo "ok   $1: $2"; else echo "FAIL $1: got '$2', expected '$3'"; failed=1; fi
}

mkdir -p "$tmp/archive/framework"
echo 'int x;' >"$tmp/archive/framework/a.cpp"
expect "a tree without .git" "$(commit_of "$tmp/archive" "$tmp/h1")" unknown

if command -v git >/dev/null; then
  repo=$tmp/repo
  mkdir -p "$repo/sub"
  git -C "$repo" init -q
  echo one >"$repo/file.txt"
  echo two >"$repo/sub/other.txt"
  git -C "$repo" add file.txt sub/other.txt
  git -C "$repo" -c user.name=t -c user.email=t@t commit -q -m first
  hash=$(git -C "$repo" rev-parse --short HEAD)
  expect "a clean work tree" "$(commit_of "$repo" "$tmp/h2")" "$hash"
  before=$(stat -c %Y.%s "$tmp/h2")
  sleep 1
  commit_of "$repo" "$tmp/h2" >/dev/null
  expect "the same commit again leaves the header untouched" "$(stat -c %Y.%s "$tmp/h2")" "$before"
  echo untracked >"$repo/new.txt"
  expect "an untracked file" "$(commit_of "$repo" "$tmp/h2")" "$hash"
  echo changed >>"$repo/file.txt"
  expect "a changed tracked file" "$(commit_of "$repo" "$tmp/h2")" "$hash-dirty"
  expect "a subdirectory of another repository" "$(commit_of "$repo/sub" "$tmp/h3")" unknown
else
  echo "skip: no git (only the archive case checked)"
fi

written=$(sed -n 's/^#define CARRY_GIT_COMMIT "\(.*\)"$/\1/p' "$build/framework/version_commit.h")
version=$("$build/bin/carry" --version)
case $version in
  *"(commit $written;"*) echo "ok   carry --version: $version" ;;
  *) echo "FAIL carry --version: '$version' does not name commit '$written'"; failed=1 ;;
esac
[ -n "$written" ] || { echo "FAIL: $build/framework/version_commit.h defines no commit"; failed=1; }
exit $failed
