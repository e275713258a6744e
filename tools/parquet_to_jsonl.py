"""Parquet corpora to JSONL for `carry tokenize --jsonl`: each row of each Parquet file becomes one line
{"text": ...} holding the row's text column (--column, default "text"), written in file and row order,
one row group at a time (memory stays at about one row group, whatever the file size). Rows whose
text is null are skipped and counted. Debian ships no maintained C++ Parquet reader, so carry reads
Parquet through this converter and pyarrow:

  python3 -m pip install pyarrow          # or: apt-get install python3-pyarrow where the release has it
  python3 tools/parquet_to_jsonl.py data/train-*.parquet --output data/train.jsonl [--column text]
  build/bin/carry tokenize --jsonl data/train.jsonl --output data/train.tok --tokenizer bpe:tokenizer.json

--output - writes to standard output (pipe it into a file, or `carry tokenize --jsonl /dev/stdin` is not
supported: carry reads regular files). Exits 1 with one line naming the file on a missing column, a
column that is not text, or a file pyarrow cannot read; 2 on bad arguments; 3 when pyarrow is missing."""
import argparse
import json
import os
import sys


def convert(paths, column, out, progress):
    import pyarrow.parquet as pq
    import pyarrow.types as pat

    rows = skipped = 0
    for path in paths:
        try:
            f = pq.ParquetFile(path)
        except Exception as e:  # pyarrow raises several kinds for unreadable files
            sys.exit(f'parquet_to_jsonl: {path}: cannot read it as Parquet: {e}')
        names = f.schema_arrow.names
        if column not in names:
            sys.exit(f'parquet_to_jsonl: {path}: no column "{column}" (columns: {", ".join(names)}); '
                     'name the text column with --column')
        kind = f.schema_arrow.field(column).type
        if not (pat.is_string(kind) or pat.is_large_string(kind)):
            sys.exit(f'parquet_to_jsonl: {path}: column "{column}" holds {kind}, expected text (string)')
        for g in range(f.num_row_groups):
            for text in f.read_row_group(g, columns=[column]).column(0).to_pylist():
                if text is None:
                    skipped += 1
                    continue
                out.write(json.dumps({'text': text}, ensure_ascii=False))
                out.write('\n')
                rows += 1
        if progress:
            print(f'parquet_to_jsonl: {path}: done ({rows} rows so far)', file=sys.stderr)
    return rows, skipped


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('inputs', nargs='+', help='Parquet files, converted in the order given')
    ap.add_argument('--output', required=True, help='the JSONL file to write ("-": standard output)')
    ap.add_argument('--column', default='text', help='the text column (default: text)')
    args = ap.parse_args()
    try:
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        print('parquet_to_jsonl: pyarrow is not installed; install it with "python3 -m pip install pyarrow" '
              '(or apt-get install python3-pyarrow where the release has it)', file=sys.stderr)
        sys.exit(3)
    if args.output == '-':
        rows, skipped = convert(args.inputs, args.column, sys.stdout, False)
    else:
        temp = f'{args.output}.tmp.{os.getpid()}'
        try:
            with open(temp, 'w', encoding='utf-8', newline='\n') as out:
                rows, skipped = convert(args.inputs, args.column, out, True)
            os.replace(temp, args.output)  # complete files only under the final name
        finally:
            if os.path.exists(temp):
                os.remove(temp)
    print(f'parquet_to_jsonl: wrote {rows} documents to {args.output}'
          + (f' ({skipped} null rows skipped)' if skipped else ''), file=sys.stderr)


if __name__ == '__main__':
    main()
