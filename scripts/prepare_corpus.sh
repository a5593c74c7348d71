#!/usr/bin/env bash
# Builds the default training corpus: Debian's `fortunes` package (fortune-mod's English
# quotation files, BSD-licensed; /usr/share/doc/fortunes/copyright) -> JSON lines, one fortune per
# document, in file-name then file order -> build/preprocess_data (byte tokenizer, EOD appended)
# -> data/fortunes_text_document.{bin,idx}. Idempotent: does nothing if the output exists.
# PREPROCESS_DATA names another preprocess_data binary (build-gpu/preprocess_data on a GPU machine).
set -euo pipefail
PREPROCESS_DATA=$(realpath -m -- "${PREPROCESS_DATA:-$(dirname "$0")/../build/preprocess_data}")  # before the cd
cd "$(dirname "$0")/.."
out=data/fortunes
[ -f "${out}_text_document.idx" ] && [ -f "${out}_text_document.bin" ] && exit 0
src=/usr/share/games/fortunes
[ -d "$src" ] || { echo "prepare_corpus: $src missing (apt-get install fortunes)" >&2; exit 3; }
[ -x "$PREPROCESS_DATA" ] || { echo "prepare_corpus: $PREPROCESS_DATA missing (scripts/setup.sh builds it)" >&2; exit 2; }
mkdir -p data
python3 - "$src" data/fortunes.jsonl <<'PY'
import json, os, sys
src, dst = sys.argv[1], sys.argv[2]
count = 0
with open(dst, "w", encoding="utf-8") as out:
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if name.endswith((".dat", ".u8")) or not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        for fortune in text.split("\n%\n"):
            fortune = fortune.strip("%\n")
            if fortune.strip():
                out.write(json.dumps({"text": fortune}) + "\n")
                count += 1
print(f"prepare_corpus: {count} fortunes -> {dst}", file=sys.stderr)
PY
"$PREPROCESS_DATA" --input data/fortunes.jsonl --output-prefix "$out" --tokenizer-type byte --append-eod --workers 2
