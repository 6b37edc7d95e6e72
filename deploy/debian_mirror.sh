# Sourced by scripts that debootstrap Debian bookworm (.ci/compose_up.sh,
# deploy/smoke_arm64_emulated.sh): debian_mirror prints the mirror to use,
# DEBIAN_MIRROR when set, else the host's own apt source for bookworm's main
# component (deb822 .sources files, then sources.list), else nothing.
debian_mirror() {
    if [ -n "${DEBIAN_MIRROR:-}" ]; then
        echo "$DEBIAN_MIRROR"
        return
    fi
    local f
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] || continue
        awk 'BEGIN{RS=""} /Suites:[^\n]*bookworm( |\n|$)/ && /Components:[^\n]*main/ {
                 if (match($0, /URIs: *[^ \n]+/)) { u = substr($0, RSTART, RLENGTH); sub(/URIs: */, "", u); print u; exit } }' "$f"
    done | head -n 1 | grep . && return
    awk '$1 == "deb" && $3 == "bookworm" { print $2; exit }' /etc/apt/sources.list 2>/dev/null || true
}
