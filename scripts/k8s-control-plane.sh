#!/usr/bin/env bash
# Builds a real Kubernetes control plane (kube-apiserver, kube-scheduler, kubelet v1.20.2 and a
# kubelet fake-CRI runtime) from Debian's `kubernetes` source package, for the end-to-end tests in
# tests/k8s/real/. Debian ships the source but no binaries, and nothing else can be downloaded, so
# this is the only way to get a real API server here. Idempotent and cached: the binaries go to
# $GPUPOOL_K8S_CACHE/<sha256 of the orig tarball, 16 hex>/bin (default ~/.cache/gpupool-k8s); a
# second run finds them and returns at once.
#
#   bash scripts/k8s-control-plane.sh install  # apt packages + Debian source (~95 MB debs, ~35 MB src)
#   bash scripts/k8s-control-plane.sh build    # install, then the binaries (cold ~10 min on 2 idle cores)
#   bash scripts/k8s-control-plane.sh bin      # prints the bin directory if the build is there
#
# Needs root (apt). Prints the bin directory as its last line.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
CACHE=${GPUPOOL_K8S_CACHE:-$HOME/.cache/gpupool-k8s}
DL=$CACHE/download
mkdir -p "$DL"

tarball() { ls "$DL"/kubernetes_*.orig.tar.gz 2>/dev/null | head -1; }
key() { sha256sum "$(tarball)" | cut -c1-16; }

install() {
  local pkgs="etcd-server etcd-client golang-go golang-github-modern-go-reflect2-dev openssl rsync make iproute2 util-linux"
  if ! dpkg -s $pkgs >/dev/null 2>&1; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q $pkgs
  fi
  if [ -z "$(tarball)" ]; then
    # deb-src entries, so that `apt-get source` can fetch Debian's kubernetes source package.
    if ! grep -rqs '^Types: deb-src' /etc/apt/sources.list.d/ && ! grep -qs '^deb-src' /etc/apt/sources.list; then
      cat > /etc/apt/sources.list.d/gpupool-debian-src.sources <<'SRC'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
      apt-get update -q
    fi
    (cd "$DL" && apt-get source -q --download-only kubernetes)
  fi
  local src
  src=$CACHE/$(key)/src
  if [ ! -d "$src" ]; then
    mkdir -p "$src.tmp" && tar xzf "$(tarball)" -C "$src.tmp"
    mv "$src.tmp"/kubernetes-* "$src" && rmdir "$src.tmp"
  fi
  # Go >= 1.18 crashes the vendored modern-go/reflect2 1.0.1 (kube-apiserver dies with "fatal
  # error: fault" in mapiterinit on its first pod create): use Debian's reflect2 1.0.2 instead.
  local r=$src/vendor/github.com/modern-go/reflect2
  if [ -f "$r/go_below_17.go" ]; then
    rm -f "$r"/go_above_17.go "$r"/go_below_17.go "$r"/go_below_19.go
    cp /usr/share/gocode/src/github.com/modern-go/reflect2/*.go /usr/share/gocode/src/github.com/modern-go/reflect2/*.s "$r"/
  fi
}

build() {
  install
  local dir src out
  dir=$CACHE/$(key); src=$dir/src; out=$dir/bin
  if [ -x "$out/kube-apiserver" ] && [ -x "$out/kube-scheduler" ] && [ -x "$out/kubelet" ] \
      && [ -x "$out/fakecri" ] && cmp -s "$HERE/k8s/fakecri/main.go" "$out/fakecri.go"; then
    echo "$out"; return
  fi
  local t0=$SECONDS
  if [ ! -x "$src/_output/bin/kubelet" ] || [ ! -x "$src/_output/bin/kube-apiserver" ] || [ ! -x "$src/_output/bin/kube-scheduler" ]; then
    # Kubernetes' own make: builds its code generators, generates the OpenAPI code, then the
    # binaries, all from vendor/ (no module download).
    (cd "$src" && CGO_ENABLED=0 make WHAT="cmd/kube-apiserver cmd/kube-scheduler cmd/kubelet")
  fi
  # The kubelet's own fake CRI runtime (pkg/kubelet/cri/remote/fake) wrapped in a main: pods
  # reach Running with no container process (no image registry here for a real runtime).
  mkdir -p "$src/cmd/gpupool-fakecri"
  cp "$HERE/k8s/fakecri/main.go" "$src/cmd/gpupool-fakecri/main.go"
  # Built as Kubernetes' make builds (GOPATH mode on the tree's own vendor/).
  (cd "$src/_output/local/go/src/k8s.io/kubernetes" && GOPATH=$src/_output/local/go \
    GO111MODULE=off CGO_ENABLED=0 go build -o "$src/_output/bin/fakecri" ./cmd/gpupool-fakecri)
  mkdir -p "$out.tmp"
  cp "$src"/_output/bin/{kube-apiserver,kube-scheduler,kubelet,fakecri} "$out.tmp"/
  cp "$HERE/k8s/fakecri/main.go" "$out.tmp/fakecri.go"
  rm -rf "$out" && mv "$out.tmp" "$out"
  echo "built in $((SECONDS - t0)) s" >&2
  echo "$out"
}

bin() {
  local t out
  t=$(tarball); [ -n "$t" ] || exit 1
  out=$CACHE/$(key)/bin
  [ -x "$out/kube-apiserver" ] && [ -x "$out/fakecri" ] || exit 1
  echo "$out"
}

"${1:?install|build|bin}"
