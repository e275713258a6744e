#!/bin/bash
# tools/docs_corpus.py on a made-up root holding every source folder: HTML pages become their text (no
# script, style or head), reST and gzip-compressed Markdown are read as they are, a repeated document and
# a too-short one are left out, Python's test folder is skipped, every 40th document is held out, the
# output is the same on a second run; a missing package's folder is one line naming it (exit 1).
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
dir=$(mktemp -d /tmp/carry_docs_corpus_XXXXXX)
trap 'rm -rf "$dir"' EXIT
python3 - "$root/tools" "$dir/root" <<'PY' || exit 1
import gzip, os, sys
sys.path.insert(0, sys.argv[1])
import docs_corpus as d
root = sys.argv[2]
body = 'Sentence number {} of document {}, long enough to be kept as a document of the corpus. '
for i, (package, rel, suffixes, how) in enumerate(d.SOURCES):
    base = os.path.join(root, rel)
    os.makedirs(base, exist_ok=True)
    for j in range(5):
        text = ''.join(body.format(k, f'{i}.{j}') for k in range(4))
        suffix = suffixes[0]
        name = os.path.join(base, f'doc{j}{suffix}' if suffix else f'LICENSE{j}')
        if how == 'html':
            text = (f'<html><head><title>T{i}</title><style>p {{color: red}}</style></head><body>'
                    f'<script>var hidden = 1;</script><p>{text}</p><p>second &amp; paragraph</p></body></html>')
        data = text.encode()
        if suffix.endswith('.gz'):
            data = gzip.compress(data)
        open(name, 'wb').write(data)
    open(os.path.join(base, 'short' + suffixes[0]), 'w').write('too short')
    if how != 'html':  # a copy of doc0 under another name: left out
        src = os.path.join(base, f'doc0{suffixes[0]}' if suffixes[0] else 'LICENSE0')
        open(os.path.join(base, 'zz_copy' + suffixes[0]), 'wb').write(open(src, 'rb').read())
os.makedirs(os.path.join(root, 'usr/lib/python3.11/test'), exist_ok=True)
open(os.path.join(root, 'usr/lib/python3.11/test/test_x.py'), 'w').write('TESTFILE ' * 100)
PY
py_run() { python3 "$root/tools/docs_corpus.py" --root "$dir/root" --output "$1"; }
py_run "$dir/a" > "$dir/a.log" 2>&1 || { echo "FAIL: exit $?"; cat "$dir/a.log"; exit 1; }
py_run "$dir/b" > /dev/null 2>&1 || { echo "FAIL: second run"; exit 1; }
python3 - "$dir" "$root/tools" <<'PY' || exit 1
import json, sys
sys.path.insert(0, sys.argv[2])
import docs_corpus as d
dirn = sys.argv[1]
def lines(k, w='a'):
    return [json.loads(l)['text'] for l in open(f'{dirn}/{w}/{k}')]
train, val = lines('train.jsonl'), lines('val.jsonl')
n = len(d.SOURCES) * 5
assert len(train) + len(val) == n, (len(train), len(val), n)
assert len(val) == n // d.VAL_EVERY, len(val)
docs = train + val
assert len(set(docs)) == n, 'a repeated document was kept'
assert not any('TESTFILE' in t or 'too short' in t for t in docs), 'a skipped file was read'
html = [t for t in docs if 'second & paragraph' in t]
assert len(html) == 5 * sum(1 for s in d.SOURCES if s[3] == 'html'), len(html)
assert not any('hidden' in t or 'color' in t or t.startswith('T') for t in html), 'script, style or head in the text'
assert all(t.endswith('corpus.') or t.endswith('paragraph') for t in docs), [t[-20:] for t in docs][:3]
for k in ('train.jsonl', 'val.jsonl', 'train.txt'):
    assert open(f'{dirn}/a/{k}', 'rb').read() == open(f'{dirn}/b/{k}', 'rb').read(), k + ' differs between runs'
assert open(f'{dirn}/a/train.txt').read() == ''.join(t + '\n' for t in train)
PY
grep -q "documents, .* MB of text (.* held out)" "$dir/a.log" || { echo "FAIL: summary"; cat "$dir/a.log"; exit 1; }
rm -rf "$dir/root/usr/share/doc/git-doc"
out=$(py_run "$dir/c" 2>&1); rc=$?
[ $rc -eq 1 ] || { echo "FAIL: a missing folder gives exit $rc"; exit 1; }
case "$out" in *"git-doc: not found; expected the files of Debian package git-doc"*) ;; *) echo "FAIL: $out"; exit 1 ;; esac
echo OK
