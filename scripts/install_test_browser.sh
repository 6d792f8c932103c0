#!/usr/bin/env bash
# The browser the dashboard's test drives (tests/engine/test_dashboard_browser.py): Debian's chromium and its
# chromium-driver, through selenium (the `test` extra). Installs both with apt when either is missing; needs root (or
# password-less sudo). Nothing else is fetched: selenium is pointed at these binaries and never downloads a browser.
set -euo pipefail

if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_test_browser.sh: no apt-get here; install chromium and chromedriver yourself" >&2
  exit 1
fi
sudo=()
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    sudo=(sudo -n)
  else
    echo "install_test_browser.sh: run as root (apt-get install -y chromium chromium-driver)" >&2
    exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
echo "+ apt-get install chromium chromium-driver (for the dashboard's browser test)"
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq chromium chromium-driver >/dev/null
chromium --version
