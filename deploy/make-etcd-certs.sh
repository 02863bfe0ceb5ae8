#!/usr/bin/env bash
# For overlays/etcd: makes the TLS material of an etcd of your own that runs outside the
# pod network (on hosts), and prints the Secret `ipward-etcd` (namespace ipward-system)
# that ipward's agents and controllers read: endpoints, ca.crt, and a client certificate
# (tls.crt, tls.key). The members' certificate (server and peer, for every host named in
# ENDPOINTS) is left in OUTDIR: server.crt, server.key, ca.crt, for each member's
#   --cert-file --key-file --trusted-ca-file --client-cert-auth
#   (and the same as --peer-* for the members among themselves).
# Usage: deploy/make-etcd-certs.sh HOST:PORT[,HOST:PORT...] [OUTDIR] | kubectl apply -f -
# Needs openssl and kubectl. Keep OUTDIR (it holds the CA key) somewhere safe.
set -euo pipefail
endpoints=${1:?usage: $0 HOST:PORT[,HOST:PORT...] [OUTDIR]}
out=${2:-$(mktemp -d)}
days=${IPWARD_CERT_DAYS:-3650}
mkdir -p "$out"
cd "$out"

openssl req -x509 -newkey rsa:2048 -nodes -days "$days" -subj "/CN=ipward-etcd-ca" \
  -keyout ca.key -out ca.crt 2>/dev/null

sans="DNS:localhost,IP:127.0.0.1"
IFS=, read -ra members <<<"$endpoints"
for member in "${members[@]}"; do
  host=${member%:*}
  host=${host#[}
  host=${host%]}
  if [[ $host =~ ^[0-9.]+$ || $host == *:* ]]; then
    sans="$sans,IP:$host"
  else
    sans="$sans,DNS:$host"
  fi
done
openssl req -newkey rsa:2048 -nodes -subj "/CN=ipward-etcd" -keyout server.key -out server.csr 2>/dev/null
printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\n' "$sans" > server.ext
openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days "$days" \
  -extfile server.ext -out server.crt 2>/dev/null

openssl req -newkey rsa:2048 -nodes -subj "/CN=ipward" -keyout client.key -out client.csr 2>/dev/null
printf 'extendedKeyUsage=clientAuth\n' > client.ext
openssl x509 -req -in client.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days "$days" \
  -extfile client.ext -out client.crt 2>/dev/null

kubectl create secret generic ipward-etcd --namespace ipward-system --dry-run=client -o yaml \
  --from-literal=endpoints="$endpoints" \
  --from-file=ca.crt=ca.crt --from-file=tls.crt=client.crt --from-file=tls.key=client.key
echo "certificates in $out (the members': server.crt, server.key, ca.crt)" >&2
