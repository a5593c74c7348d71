#!/usr/bin/env bash
# Run HERE (Debian 12, with its package registry), before a GPU session: downloads the C++
# libraries trainer needs beside LibTorch as Debian packages and unpacks them into .gpu-deps/
# (git-ignored), the folder that travels to a GPU machine that has PyTorch's CUDA wheel but no
# package registry. yaml-cpp, spdlog and fmt are shared libraries (Debian 12 builds run on any
# newer glibc); CLI11, nlohmann-json and Catch2 are headers. Also copies the default corpus
# (data/fortunes_text_document.*) into .gpu-deps/data for the benchmarks.
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=.gpu-deps
packages="libyaml-cpp-dev libyaml-cpp0.7 libspdlog-dev libspdlog1.10 libfmt-dev libfmt9 libcli11-dev nlohmann-json3-dev catch2"
rm -rf "$dest" && mkdir -p "$dest/debs" "$dest/data"
(cd "$dest/debs" && apt-get download $packages)
for deb in "$dest"/debs/*.deb; do dpkg -x "$deb" "$dest"; done
rm -rf "$dest/debs" "$dest/usr/share/doc" "$dest/usr/share/man"
[ -f data/fortunes_text_document.bin ] || scripts/prepare_corpus.sh
cp data/fortunes_text_document.bin data/fortunes_text_document.idx "$dest/data/"
du -sh "$dest"
echo "ready: name .gpu-deps in the device run's carry list, then run scripts/gpu/run_all.sh there"
