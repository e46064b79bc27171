"""Build the real control plane's programs from the Go module proxy, once per machine.

``python -m tests.support.controlplane.build [COMPONENT ...]`` (``make controlplane``) builds each
component's programs from its wrapper module in ``tools/controlplane/<component>/`` into a cache
folder outside the checkout, keyed by the component's pinned version and a digest of its wrapper
(go.mod, go.sum, the programs and their flags), so a fresh clone on the same machine reuses them and
a second run builds nothing.  A build goes to a temporary folder renamed into place when it is
whole; a lock keeps two builds of one key from running at once.

The cache is ``$RESILIENCED_CP_CACHE``, else ``$XDG_CACHE_HOME/resilienced/controlplane``, else
``~/.cache/resilienced/controlplane``.  Each built folder holds ``bin/``, the CRDs its modules ship
(``crds/``), kwok's stages (``stages/``) and ``BUILD.json`` (versions, the Go used, seconds taken).
docs/development.md, "The real control plane".
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
WRAPPERS = ROOT / "tools" / "controlplane"


@dataclass(frozen=True)
class Copy:
    """Files a build copies out of a module of its wrapper: ``module``'s ``path`` (a folder or a
    file, relative to the module's root) into ``dest`` (relative to the built folder)."""

    module: str
    path: str
    dest: str
    pattern: str = "*.yaml"


@dataclass(frozen=True)
class Component:
    name: str
    version: str
    #: program name -> Go package
    programs: Mapping[str, str]
    ldflags: str = "-s -w"
    copies: Sequence[Copy] = field(default_factory=tuple)
    #: part of the control plane (``make controlplane``), not a tool of its own
    plane: bool = True

    @property
    def wrapper(self) -> Path:
        return WRAPPERS / self.name

    def key(self) -> str:
        digest = hashlib.sha256()
        for name in ("go.mod", "go.sum"):
            digest.update((self.wrapper / name).read_bytes())
        digest.update(json.dumps([dict(self.programs), self.ldflags,
                                  [c.__dict__ for c in self.copies]], sort_keys=True).encode())
        digest.update(_go_version().encode())
        return f"{self.name}-{self.version}-{digest.hexdigest()[:12]}"


def _stamp(version: str) -> str:
    """The ldflags hack/lib/version.sh's kube::version::ldflags gives (k8s.io/kubernetes v1.37.2):
    without them the binaries say v0.0.0-master+$Format:%H$."""
    major, minor = version.lstrip("v").split(".")[:2]
    out = ["-s", "-w"]
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        out += [f"-X {pkg}.gitVersion={version}", f"-X {pkg}.gitMajor={major}",
                f"-X {pkg}.gitMinor={minor}", f"-X {pkg}.gitTreeState=clean"]
    return " ".join(out)


KUBE_VERSION = "v1.37.2"
HELM_VERSION = "v4.3.2"
COMPONENTS: dict[str, Component] = {c.name: c for c in (
    Component("k8s", KUBE_VERSION, {
        "kube-apiserver": "k8s.io/kubernetes/cmd/kube-apiserver",
        "kube-controller-manager": "k8s.io/kubernetes/cmd/kube-controller-manager",
        "kube-scheduler": "k8s.io/kubernetes/cmd/kube-scheduler",
        "kubectl": "k8s.io/kubernetes/cmd/kubectl",
        "etcd": "go.etcd.io/etcd/server/v3",
    }, ldflags=_stamp(KUBE_VERSION)),
    Component("kwok", "v0.8.0", {"kwok": "sigs.k8s.io/kwok/cmd/kwok"}, copies=(
        Copy("sigs.k8s.io/kwok", "kustomize/stage/node/fast/node-initialize.yaml", "stages"),
        Copy("sigs.k8s.io/kwok", "kustomize/stage/node/heartbeat/node-heartbeat.yaml", "stages"),
        Copy("sigs.k8s.io/kwok", "kustomize/stage/pod/fast/pod-ready.yaml", "stages"),
        Copy("sigs.k8s.io/kwok", "kustomize/stage/pod/fast/pod-delete.yaml", "stages"),
    )),
    Component("kuberay", "v1.6.0", {"ray-operator": "github.com/ray-project/kuberay/ray-operator"}, copies=(
        Copy("github.com/ray-project/kuberay/ray-operator", "config/crd/bases", "crds"),
    )),
    Component("kueue", "v0.17.0", {"kueue": "sigs.k8s.io/kueue/cmd/kueue"}, copies=(
        Copy("sigs.k8s.io/kueue", "config/components/crd/bases", "crds"),
        Copy("sigs.k8s.io/kueue", "config/components/webhook/manifests.yaml", "webhooks"),
    )),
    # helm's own Makefile stamps its version (else `helm version` says v4.3, the source's default).
    Component("helm", HELM_VERSION, {"helm": "helm.sh/helm/v4/cmd/helm"}, plane=False,
              ldflags=f"-s -w -X helm.sh/helm/v4/internal/version.version={HELM_VERSION} "
                      "-X helm.sh/helm/v4/internal/version.gitTreeState=clean"),
)}
#: What ``make controlplane`` builds: the plane's components (helm has ``make helm``).
PLANE = tuple(name for name, c in COMPONENTS.items() if c.plane)


def cache_root() -> Path:
    if os.environ.get("RESILIENCED_CP_CACHE"):
        return Path(os.environ["RESILIENCED_CP_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "resilienced" / "controlplane"


_GO_VERSION: list[str] = []


def _go_version() -> str:
    if not _GO_VERSION:
        go = shutil.which("go")
        if go is None:
            raise MissingBuild("go is not on the PATH: the control plane is built from the Go module proxy "
                               "(docs/development.md, \"The real control plane\")")
        _GO_VERSION.append(subprocess.run([go, "env", "GOVERSION"], check=True, capture_output=True,
                                          text=True).stdout.strip())
    return _GO_VERSION[0]


class MissingBuild(RuntimeError):
    """A component is not built (run ``make controlplane``) or cannot be."""


def _go_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(CGO_ENABLED="0", GOFLAGS="-trimpath -mod=readonly", GOTOOLCHAIN="local", GOWORK="off")
    return env


def _module_dir(component: Component, module: str) -> Path:
    out = subprocess.run(["go", "list", "-m", "-json", module], cwd=component.wrapper, env=_go_env(),
                         check=True, capture_output=True, text=True).stdout
    info = json.loads(out)
    if not info.get("Dir"):
        subprocess.run(["go", "mod", "download", module], cwd=component.wrapper, env=_go_env(), check=True)
        info = json.loads(subprocess.run(["go", "list", "-m", "-json", module], cwd=component.wrapper,
                                         env=_go_env(), check=True, capture_output=True, text=True).stdout)
    return Path(info["Dir"])


def built(name: str) -> Path:
    """The built folder of component ``name``; :class:`MissingBuild` naming the make target if absent."""
    component = COMPONENTS[name]
    folder = cache_root() / component.key()
    if not (folder / "BUILD.json").exists():
        what, target = (f"the control plane's {name}", "make controlplane") if component.plane else (name, f"make {name}")
        raise MissingBuild(f"{what} ({component.version}) is not built in {folder}: run `{target}`")
    return folder


def program(name: str) -> Path:
    """The path of a built program (``kube-apiserver``, ``etcd``, ``kwok``, ...)."""
    for component in COMPONENTS.values():
        if name in component.programs:
            return built(component.name) / "bin" / name
    raise KeyError(f"no component builds {name!r}")


def build(component: Component, *, log: object = sys.stderr) -> Path:
    """Build ``component`` unless its key is already in the cache; the built folder."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    folder = root / component.key()
    with open(root / f".lock-{component.key()}", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (folder / "BUILD.json").exists():
            print(f"controlplane: {component.name} {component.version} already built: {folder}", file=log)
            return folder
        partial = root / f".partial-{component.key()}-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        (partial / "bin").mkdir(parents=True)
        print(f"controlplane: building {component.name} {component.version} into {folder}", file=log, flush=True)
        started = time.monotonic()
        for program_name, package in component.programs.items():
            t0 = time.monotonic()
            subprocess.run(["go", "build", "-ldflags", component.ldflags, "-o",
                            str(partial / "bin" / program_name), package],
                           cwd=component.wrapper, env=_go_env(), check=True)
            print(f"controlplane:   {program_name} in {time.monotonic() - t0:.0f} s", file=log, flush=True)
        for copy in component.copies:
            source = _module_dir(component, copy.module) / copy.path
            dest = partial / copy.dest
            dest.mkdir(parents=True, exist_ok=True)
            files = [source] if source.is_file() else sorted(source.glob(copy.pattern))
            if not files:
                raise MissingBuild(f"{copy.module}: nothing matches {copy.path}/{copy.pattern}")
            for f in files:
                shutil.copyfile(f, dest / f.name)
        (partial / "BUILD.json").write_text(json.dumps({
            "component": component.name, "version": component.version, "go": _go_version(),
            "programs": dict(component.programs), "seconds": round(time.monotonic() - started, 1),
        }, indent=2) + "\n")
        shutil.rmtree(folder, ignore_errors=True)
        partial.rename(folder)
        print(f"controlplane: {component.name} built in {time.monotonic() - started:.0f} s", file=log)
        return folder


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.controlplane.build", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("components", nargs="*", metavar="COMPONENT",
                        help=f"what to build (default: the plane's {', '.join(PLANE)}; also: helm)")
    args = parser.parse_args(argv)
    unknown = [name for name in args.components if name not in COMPONENTS]
    if unknown:
        parser.error(f"unknown component(s) {', '.join(unknown)}: choose from {', '.join(COMPONENTS)}")
    try:
        for name in args.components or PLANE:
            build(COMPONENTS[name])
    except subprocess.CalledProcessError as e:
        print(f"controlplane: {' '.join(map(str, e.cmd))} failed with exit status {e.returncode}", file=sys.stderr)
        return 1
    except MissingBuild as e:
        print(f"controlplane: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
