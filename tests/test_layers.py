"""The package layering, checked by walking every module's imports (function-level ones included).

- The front end (rollout/frontend, rollout/server) talks to the engine only through rollout/ipc:
  it imports nothing from rollout.core or rollout.exec (and so neither torch's engine code nor
  EngineCore), except rollout/frontend/inproc_client.py, which runs the engine loop itself.
- The engine's layers import downward only: rollout.core -> rollout.exec -> rollout.models ->
  rollout.batch -> capture; capture imports nothing from rollout.
- The shared modules (rollout/*.py, rollout/config, rollout/ipc, rollout/exact) import no engine
  layer (but the wire codec, capture/codec.py) and no front end, so both sides may use them; the
  package itself (rollout/__init__.py) exports the front end's Rollout, and rollout/config may ask
  the models and capture (never core or exec) what they support, to resolve defaults.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINE_LAYERS = ["rollout.core", "rollout.exec", "rollout.models", "rollout.batch", "capture"]
FRONT_END = ("rollout.frontend", "rollout.server")
SHARED = ("rollout.config", "rollout.ipc", "rollout.exact")
IN_PROCESS_ENGINE = "rollout.frontend.inproc_client"
CONFIG_MAY_ASK = ENGINE_LAYERS.index("rollout.models")   # NOTE: defaults resolved by what the kernels support
WIRE_CODEC = "capture.codec"   # NOTE: the routing rows' wire format, shared by engine, front end and trainer


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _layer(module: str):
    for i, package in enumerate(ENGINE_LAYERS):
        if _under(module, package):
            return i
    return None


def _modules():
    for path in sorted(ROOT.glob("rollout/**/*.py")) + sorted(ROOT.glob("capture/**/*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        yield name, path


def _imports(name: str, path: Path) -> set:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                found.add(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                found.add(node.module)
    return {m for m in found if _under(m, "rollout") or _under(m, "capture")}


def _violations():
    for name, path in _modules():
        mine = _layer(name)
        front = any(_under(name, p) for p in FRONT_END)
        shared = mine is None and not front
        for imported in sorted(_imports(name, path)):
            theirs = _layer(imported)
            if front and theirs is not None and theirs <= 1 and name != IN_PROCESS_ENGINE:
                yield f"{name} (front end) imports {imported}"
            elif mine is not None and theirs is not None and theirs < mine:
                yield f"{name} ({ENGINE_LAYERS[mine]}) imports {imported}, a layer above it"
            elif mine is not None and any(_under(imported, p) for p in FRONT_END):
                yield f"{name} (engine) imports the front end's {imported}"
            elif name.startswith("capture") and imported.startswith("rollout"):
                yield f"{name} (capture) imports {imported}"
            elif shared and name != "rollout" and imported != WIRE_CODEC and (
                    any(_under(imported, p) for p in FRONT_END)
                    or (theirs is not None and not (_under(name, "rollout.config") and theirs >= CONFIG_MAY_ASK))):
                yield f"{name} (shared) imports {imported}"


def test_the_walk_sees_every_package():
    names = {name for name, _ in _modules()}
    for package in ENGINE_LAYERS + list(FRONT_END) + list(SHARED):
        assert any(_under(n, package) for n in names), package
    # NOTE: the checker itself must see a real import of each kind, or it could pass vacuously
    assert "rollout.core.engine_core" in _imports("rollout.frontend.inproc_client",
                                                  ROOT / "rollout/frontend/inproc_client.py")


def test_imports_respect_the_layers():
    bad = list(_violations())
    assert not bad, "\n".join(bad)
