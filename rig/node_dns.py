"""The DNS watcher stand-in: cluster DNS records for the node cluster (`hack/node.sh`), fed to dnsmasq.

This is the one stand-in of the node cluster. No registry this project can reach ships CoreDNS or kube-dns,
so a real DNS server (dnsmasq, authoritative for the cluster domain) answers the pods' queries from a hosts
file that this watcher writes from the API server's objects, following Kubernetes' DNS specification for what
it covers:

- `<service>.<namespace>.svc.<domain>`: the ClusterIP, or for a headless Service every ready address of its
  Endpoints;
- `<hostname>.<service>.<namespace>.svc.<domain>`: each Endpoints address that carries a hostname (the
  endpoints controller sets it for a pod whose `spec.hostname` and `spec.subdomain` name the Service:
  StatefulSet pods).

Not covered: SRV records, `<ip>.<namespace>.pod.<domain>` names, ExternalName Services. After each change the
file is replaced atomically and dnsmasq is sent SIGHUP, which makes it reread the file and drop its cache.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kubernetes import client, config, watch

Key = tuple[str, str]


def records(
    services: Mapping[Key, Mapping[str, Any]], endpoints: Mapping[Key, Mapping[str, Any]], domain: str
) -> list[tuple[str, str]]:
    """(address, name) pairs for the hosts file, sorted, from Services and Endpoints as the API gives them."""
    out: set[tuple[str, str]] = set()
    for (namespace, name), svc in services.items():
        spec = svc.get("spec") or {}
        fqdn = f"{name}.{namespace}.svc.{domain}"
        cluster_ip = spec.get("clusterIP")
        if cluster_ip and cluster_ip != "None":
            out.add((cluster_ip, fqdn))
            continue
        for subset in (endpoints.get((namespace, name)) or {}).get("subsets") or []:
            for address in subset.get("addresses") or []:
                out.add((address["ip"], fqdn))
                if address.get("hostname"):
                    out.add((address["ip"], f"{address['hostname']}.{fqdn}"))
    return sorted(out, key=lambda r: (r[1], r[0]))


def render(pairs: list[tuple[str, str]]) -> str:
    lines = ["# written by disagg.rig.node_dns (the DNS watcher stand-in); do not edit"]
    lines += [f"{ip} {name}" for ip, name in pairs]
    return "\n".join(lines) + "\n"


class Watcher:
    def __init__(self, hosts: Path, dnsmasq_pid: Path, domain: str) -> None:
        self.hosts = hosts
        self.dnsmasq_pid = dnsmasq_pid
        self.domain = domain
        self.services: dict[Key, dict[str, Any]] = {}
        self.endpoints: dict[Key, dict[str, Any]] = {}
        self.lock = threading.Lock()
        self.written = ""

    def apply(self, store: dict[Key, dict[str, Any]], kind: str, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        key = (meta.get("namespace", ""), meta.get("name", ""))
        with self.lock:
            if kind == "DELETED":
                store.pop(key, None)
            else:
                store[key] = obj
            self.flush()

    def replace(self, store: dict[Key, dict[str, Any]], items: list[dict[str, Any]]) -> None:
        with self.lock:
            store.clear()
            for obj in items:
                meta = obj.get("metadata") or {}
                store[(meta.get("namespace", ""), meta.get("name", ""))] = obj
            self.flush()

    def flush(self) -> None:
        text = render(records(self.services, self.endpoints, self.domain))
        if text == self.written:
            return
        tmp = self.hosts.with_suffix(".tmp")
        tmp.write_text(text)
        os.chmod(tmp, 0o644)
        tmp.replace(self.hosts)
        self.written = text
        try:
            os.kill(int(self.dnsmasq_pid.read_text().strip()), signal.SIGHUP)
        except (OSError, ValueError) as exc:
            print(f"node_dns: could not signal dnsmasq: {exc}", flush=True)

    def follow(self, store: dict[Key, dict[str, Any]], lister: Callable[..., Any]) -> None:
        """List, then watch from the list's resourceVersion; relist after a 410 or a broken stream."""
        api = client.ApiClient()
        while True:
            try:
                body = json.loads(lister(_preload_content=False).data)
                self.replace(store, body.get("items") or [])
                version = body["metadata"]["resourceVersion"]
                stream = watch.Watch().stream  # type: ignore[no-untyped-call]
                for event in stream(lister, resource_version=version, timeout_seconds=300):  # type: ignore[no-untyped-call]
                    obj = api.sanitize_for_serialization(event["object"])  # type: ignore[no-untyped-call]
                    if event["type"] == "ERROR":
                        break
                    self.apply(store, event["type"], obj)
            except client.ApiException as exc:
                print(f"node_dns: {exc.status} {exc.reason}; relisting", flush=True)
                time.sleep(1)
            except Exception as exc:  # a broken stream of any kind: relist and go on
                print(f"node_dns: {type(exc).__name__}: {exc}; relisting", flush=True)
                time.sleep(1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--hosts", required=True, type=Path)
    parser.add_argument("--dnsmasq-pid", required=True, type=Path)
    parser.add_argument("--domain", default="cluster.local")
    args = parser.parse_args(argv)
    config.load_kube_config(config_file=args.kubeconfig)  # type: ignore[no-untyped-call]
    core = client.CoreV1Api()
    watcher = Watcher(args.hosts, args.dnsmasq_pid, args.domain)
    follows = (
        (watcher.services, core.list_service_for_all_namespaces),
        (watcher.endpoints, core.list_endpoints_for_all_namespaces),
    )
    threads = [threading.Thread(target=watcher.follow, args=follow, daemon=True) for follow in follows]
    for thread in threads:
        thread.start()
    print(f"node_dns: writing {args.hosts} for dnsmasq", flush=True)
    for thread in threads:
        thread.join()


if __name__ == "__main__":
    main()
