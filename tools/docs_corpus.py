"""An English text corpus built offline from Debian packages' documentation, for runs on real text
without a download: the Python, Perl, PostgreSQL, Git, Sphinx, CMake, SQLAlchemy, Django, Node.js,
SciPy, Octave and Boost manuals, the Debian Administrator's Handbook and Debian Reference, the common
licenses, and the Python standard library's and Perl's modules (code with their documentation). Every
document is one line {"text": ...} of train.jsonl or val.jsonl (every 40th document, in path order, is
held out; the training documents follow in a fixed pseudo-random order), and train.txt holds the
training text for a tokenizer to learn from.

  python3 tools/docs_corpus.py --output data/docs [--root /]
  python3 tools/docs_corpus.py --packages       (the Debian packages it reads, one a line)
  (tools/docs_corpus_build installs the packages, runs this, trains the tokenizer and tokenizes)

Sources are read in sorted path order, reST/Markdown/POD/plain files as they are (gzip-compressed ones
too), HTML pages as their text (scripts, styles and the head left out), Sphinx trees from their reST
sources when the package ships them; a document whose text repeats an earlier one byte for byte is left
out, so the output depends only on the packages' contents. Prints one line per source and a summary
with the SHA-256 of both files. Exits 1 naming the source when a package's files are missing."""
import argparse
import gzip
import hashlib
import html.parser
import json
import os
import random
import sys

# (package, directory under the root, suffixes read, how); --packages lists them for tools/docs_corpus_build.
SOURCES = [
    ('python3.11-doc', 'usr/share/doc/python3.11/html/_sources', ('.rst.txt',), 'text'),
    ('perl-doc', 'usr/share/perl/5.36/pod', ('.pod',), 'text'),
    ('postgresql-doc-15', 'usr/share/doc/postgresql-doc-15/html', ('.html',), 'html'),
    ('git-doc', 'usr/share/doc/git-doc', ('.txt',), 'text'),
    ('sphinx-doc', 'usr/share/doc/sphinx-doc/html/_sources', ('.rst.txt', '.txt'), 'text'),
    ('cmake-doc', 'usr/share/doc/cmake-data/html/_sources', ('.rst.txt',), 'text'),
    ('python-sqlalchemy-doc', 'usr/share/doc/python-sqlalchemy-doc/rst', ('.rst', '.txt'), 'text'),
    ('python-django-doc', 'usr/share/doc/python-django-doc/html', ('.html',), 'html'),
    ('nodejs-doc', 'usr/share/doc/nodejs/api', ('.md', '.md.gz'), 'text'),
    ('python-scipy-doc', 'usr/share/doc/python-scipy-doc/html', ('.html',), 'html'),
    ('octave-doc', 'usr/share/doc/octave', ('.html',), 'html'),
    ('debian-handbook', 'usr/share/doc/debian-handbook/html/en-US', ('.html',), 'html'),
    ('debian-reference-en', 'usr/share/debian-reference', ('.en.html',), 'html'),
    ('base-files', 'usr/share/common-licenses', ('',), 'text'),
    ('libpython3.11-stdlib', 'usr/lib/python3.11', ('.py',), 'text'),
    ('perl-modules-5.36', 'usr/share/perl/5.36.0', ('.pm',), 'text'),
    ('libboost1.81-doc', 'usr/share/doc/libboost1.81-doc', ('.html', '.htm'), 'html'),
]
# Folders left out of the walks: Python's own tests and whatever else is installed beside the standard library.
SKIP_DIRS = {'usr/lib/python3.11/test', 'usr/lib/python3.11/site-packages', 'usr/lib/python3.11/dist-packages',
             'usr/lib/python3.11/lib2to3/tests', 'usr/lib/python3.11/idlelib/idle_test'}
SHUFFLE_SEED = 20261207  # the training documents' order (a fixed permutation, so a stream read in order mixes sources)
VAL_EVERY = 40
MIN_CHARS = 200  # shorter documents (index stubs, redirects) are left out


class _Text(html.parser.HTMLParser):
    SKIP = {'script', 'style', 'head', 'noscript'}
    BLOCK = {'p', 'div', 'br', 'li', 'tr', 'h1', 'h2', 'h3', 'h4', 'h5', 'h6', 'pre', 'dt', 'dd', 'table',
             'section', 'blockquote', 'ul', 'ol', 'dl', 'hr'}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts, self.skip = [], 0

    def handle_starttag(self, tag, attrs):
        if tag in self.SKIP:
            self.skip += 1
        elif tag in self.BLOCK:
            self.parts.append('\n')

    def handle_endtag(self, tag):
        if tag in self.SKIP:
            self.skip = max(0, self.skip - 1)
        elif tag in self.BLOCK:
            self.parts.append('\n')

    def handle_data(self, data):
        if not self.skip:
            self.parts.append(data)


def html_text(raw):
    p = _Text()
    p.feed(raw)
    p.close()
    lines = [' '.join(l.split()) for l in ''.join(p.parts).splitlines()]
    out, blank = [], False
    for l in lines:
        if l:
            out.append(l)
            blank = False
        elif not blank and out:
            out.append('')
            blank = True
    return '\n'.join(out).strip()


def read(path):
    with open(path, 'rb') as f:
        data = f.read()
    if path.endswith('.gz'):
        data = gzip.decompress(data)
    return data.decode('utf-8', errors='replace')


def documents(root):
    for package, rel, suffixes, how in SOURCES:
        base = os.path.join(root, rel)
        if not os.path.isdir(base):
            sys.exit(f'docs_corpus: {base}: not found; expected the files of Debian package {package} '
                     f'(apt-get install {package}, or run tools/docs_corpus_build)')
        paths = []
        for d, dirs, files in os.walk(base):
            dirs[:] = sorted(x for x in dirs
                             if os.path.relpath(os.path.join(d, x), root).replace(os.sep, '/') not in SKIP_DIRS)
            for n in files:
                if any(n.endswith(s) for s in suffixes):
                    paths.append(os.path.join(d, n))
        paths.sort()
        for path in paths:
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            text = read(path)
            if how == 'html':
                text = html_text(text)
            text = text.replace('\r\n', '\n').strip()
            if len(text) >= MIN_CHARS:
                yield package, path, text


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--output', help='folder for train.jsonl, val.jsonl, train.txt')
    ap.add_argument('--root', default='/', help='where the packages are installed (default /)')
    ap.add_argument('--packages', action='store_true', help='print the Debian packages read, one a line, and exit')
    a = ap.parse_args()
    if a.packages:
        print('\n'.join(p for p, _, _, _ in SOURCES))
        return
    if not a.output:
        ap.error('--output is required')
    os.makedirs(a.output, exist_ok=True)
    seen = set()
    counts = {}
    n = 0
    train = []
    names = ('train.jsonl', 'val.jsonl', 'train.txt')
    tmp = {k: os.path.join(a.output, k + '.partial') for k in names}
    with open(tmp['train.jsonl'], 'w', encoding='utf-8') as tr, open(tmp['val.jsonl'], 'w', encoding='utf-8') as va, \
            open(tmp['train.txt'], 'w', encoding='utf-8') as tt:
        for package, path, text in documents(a.root):
            h = hashlib.sha256(text.encode('utf-8')).digest()
            if h in seen:
                continue
            seen.add(h)
            line = json.dumps({'text': text}, ensure_ascii=False) + '\n'
            c = counts.setdefault(package, [0, 0])
            c[0] += 1
            c[1] += len(text.encode('utf-8'))
            if n % VAL_EVERY == VAL_EVERY - 1:
                va.write(line)
            else:
                train.append((line, text))
            n += 1
        random.Random(SHUFFLE_SEED).shuffle(train)
        for line, text in train:
            tr.write(line)
            tt.write(text + '\n')
    for k in names:
        os.replace(tmp[k], os.path.join(a.output, k))
    for package, (docs, size) in counts.items():
        print(f'docs_corpus: {package:24s} {docs:6d} documents {size / 1e6:8.2f} MB')
    total = sum(s for _, s in counts.values())
    digests = []
    for k in ('train.jsonl', 'val.jsonl'):
        with open(os.path.join(a.output, k), 'rb') as f:
            digests.append(f'{k} sha256 {hashlib.sha256(f.read()).hexdigest()[:16]}')
    print(f'docs_corpus: {n} documents, {total / 1e6:.2f} MB of text ({n // VAL_EVERY} held out) in {a.output}; '
          + ', '.join(digests))


if __name__ == '__main__':
    main()
