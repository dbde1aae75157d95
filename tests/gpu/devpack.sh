# tests/gpu/devpack.sh: sourced by run.sh and muse_mini.sh on the GPU machine. prepare.sh packs
# .devbin, .devlibs and .devmodels into .devpack.tar.xz (as plain folders they pass the device
# tool's 64 MiB of carried files; xz takes them to about 15 MiB); this unpacks it where the
# folders are not there already.
devpack_unpack() {
    if [ ! -x .devbin/tmx ] && [ -f .devpack.tar.xz ]; then
        tar xJf .devpack.tar.xz ||
            { echo "devpack.sh: .devpack.tar.xz does not unpack" >&2; return 1; }
    fi
}
