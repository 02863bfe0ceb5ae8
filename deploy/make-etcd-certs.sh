#!/usr/bin/env bash
# Makes the TLS material for ipward's etcd and prints the two Secrets as YAML:
#   ipward-etcd-server  the members' certificate (server and peer), for components/etcd
#   ipward-etcd         what ipward's agent and controller use: endpoints, ca.crt, and a
#                       client certificate (tls.crt, tls.key)
# Usage: deploy/make-etcd-certs.sh [NAMESPACE] [OUTDIR] | kubectl apply -f -
# Needs openssl and kubectl. Keep OUTDIR (it holds the CA key) somewhere safe, or delete it.
set -euo pipefail
namespace=${1:-ipward-system}
out=${2:-$(mktemp -d)}
days=${IPWARD_CERT_DAYS:-3650}
mkdir -p "$out"
cd "$out"

openssl req -x509 -newkey rsa:2048 -nodes -days "$days" -subj "/CN=ipward-etcd-ca" \
  -keyout ca.key -out ca.crt 2>/dev/null

sans="DNS:localhost,IP:127.0.0.1"
for i in 0 1 2; do
  for domain in "ipward-etcd.$namespace.svc" "ipward-etcd.$namespace.svc.cluster.local"; do
    sans="$sans,DNS:ipward-etcd-$i.$domain"
  done
done
openssl req -newkey rsa:2048 -nodes -subj "/CN=ipward-etcd" -keyout server.key -out server.csr 2>/dev/null
printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\n' "$sans" > server.ext
openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days "$days" \
  -extfile server.ext -out server.crt 2>/dev/null

openssl req -newkey rsa:2048 -nodes -subj "/CN=ipward" -keyout client.key -out client.csr 2>/dev/null
printf 'extendedKeyUsage=clientAuth\n' > client.ext
openssl x509 -req -in client.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days "$days" \
  -extfile client.ext -out client.crt 2>/dev/null

endpoints="ipward-etcd-0.ipward-etcd.$namespace.svc:2379,ipward-etcd-1.ipward-etcd.$namespace.svc:2379,ipward-etcd-2.ipward-etcd.$namespace.svc:2379"
kubectl create secret generic ipward-etcd-server --namespace "$namespace" --dry-run=client -o yaml \
  --from-file=ca.crt=ca.crt --from-file=tls.crt=server.crt --from-file=tls.key=server.key
echo ---
kubectl create secret generic ipward-etcd --namespace "$namespace" --dry-run=client -o yaml \
  --from-literal=endpoints="$endpoints" \
  --from-file=ca.crt=ca.crt --from-file=tls.crt=client.crt --from-file=tls.key=client.key
echo "certificates in $out" >&2
