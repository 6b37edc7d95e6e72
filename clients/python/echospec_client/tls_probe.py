"""Does the server at host:port speak TLS? One TLS handshake attempt, to explain a connection that
never becomes ready: a TLS client talking to a plain-text server (grpcio reports "Tls handshake
failed ... WRONG_VERSION_NUMBER") or a plain-text client talking to a TLS server (grpcio reports
only "Socket closed"), both of which otherwise look like "unreachable".

Standard library only (socket, ssl), so the light client, the CLI and the services share it. The
probe sends a ClientHello without checking the certificate (it asks only which protocol answers,
and the real channel checks the certificate), with ALPN "h2" as gRPC's clients do.
"""
from __future__ import annotations

import ipaddress
import socket
import ssl

TLS = "tls"                  # a TLS server answered (a handshake, or a TLS alert: mTLS refusing us)
PLAIN = "plain"              # the TCP connection opened and the answer was not TLS
NO_CONNECTION = "none"       # no TCP connection (refused, unreachable, timed out)


def split_target(target: str) -> tuple[str, int] | None:
    """("host", port) of "host:port", "[v6]:port" or "ipv4:host:port"; None for what this probe
    cannot dial (a dns:/// or unix: target, no port)."""
    t = target.strip()
    for scheme in ("ipv4:", "ipv6:"):
        if t.startswith(scheme):
            t = t[len(scheme):]
    if "://" in t or t.startswith("unix:"):
        return None
    host, sep, port = t.rpartition(":")
    if not sep or not port.isdigit():
        return None
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return (host or "localhost"), int(port)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def probe(target: str, timeout_s: float = 2.0) -> str:
    """What answers at ``target``: TLS, PLAIN or NO_CONNECTION (also for a target this probe
    cannot dial)."""
    addr = split_target(target)
    if addr is None:
        return NO_CONNECTION
    try:
        sock = socket.create_connection(addr, timeout=timeout_s)
    except OSError:
        return NO_CONNECTION
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        ctx.set_alpn_protocols(["h2"])
    except NotImplementedError:   # an ssl module without ALPN
        pass
    try:
        with ctx.wrap_socket(sock, server_hostname=None if _is_ip(addr[0]) else addr[0]):
            return TLS
    except ssl.SSLError as exc:
        # an alert is a TLS record: the server speaks TLS and refused this handshake (e.g. it
        # requires a client certificate); anything else (WRONG_VERSION_NUMBER, ...) is not TLS
        return TLS if "ALERT" in str(exc.reason or exc).upper() else PLAIN
    except OSError:   # reset or closed: a plain-text gRPC server drops a ClientHello
        return PLAIN
    finally:
        sock.close()


def tcp_failure(target: str, timeout_s: float = 1.0) -> str:
    """"" or why no TCP connection to ``target`` opens, as a phrase for a connect error: the
    host name does not resolve, nothing listens on the port (refused), or no answer (timed out,
    unreachable). "" also for a target this probe cannot dial."""
    addr = split_target(target)
    if addr is None:
        return ""
    host, port = addr
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"the host name {host!r} does not resolve ({exc.strerror})"
    except (OSError, UnicodeError) as exc:
        return f"the host name {host!r} does not resolve ({exc})"
    try:
        socket.create_connection(addr, timeout=timeout_s).close()
    except ConnectionRefusedError:
        return f"connection refused: nothing listens on port {port} of {host}"
    except socket.timeout:
        return f"no answer from {host} port {port} within {timeout_s:g} s"
    except OSError as exc:
        return f"cannot open a connection to {host} port {port} ({exc.strerror or exc})"
    return ""


def mismatch(target: str, uses_tls: bool, timeout_s: float = 2.0) -> str:
    """"" unless the server at ``target`` likely speaks the other protocol than the client; then a
    sentence saying so ("the server at X speaks TLS but this client connects in plain text")."""
    answer = probe(target, timeout_s)
    if uses_tls and answer == PLAIN:
        return (f"the server at {target} answers in plain text, not TLS, but this client "
                f"connects with TLS")
    if not uses_tls and answer == TLS:
        return f"the server at {target} speaks TLS but this client connects in plain text"
    return ""


# what a gRPC client sends first (HTTP/2's connection preface); an HTTP/1 server answers it with
# an HTTP/1 status line
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_NOT_GRPC = "is it the HTTP gateway's port? The coordinator's gRPC port is another (50051 by default)"


def other_cause(target: str, uses_tls: bool, root_pem: bytes | None = None,
                server_name: str | None = None, timeout_s: float = 2.0) -> str:
    """"" or why a client that uses the right protocol (TLS or not) still cannot connect, when
    one more connection can tell: the server's certificate does not verify with ``root_pem``
    (None: the system's roots) for ``server_name`` (None: the target's host), or the server
    answers HTTP/1 (HTTPS without h2), not gRPC (the HTTP gateway's port)."""
    addr = split_target(target)
    if addr is None:
        return ""
    try:
        sock = socket.create_connection(addr, timeout=timeout_s)
    except OSError:
        return ""
    try:
        if not uses_tls:
            sock.sendall(_H2_PREFACE)
            if sock.recv(16).startswith(b"HTTP/"):
                return f"the server at {target} answers HTTP/1, not gRPC: {_NOT_GRPC}"
            return ""
        ctx = ssl.create_default_context(cadata=root_pem.decode("ascii", "replace")
                                         if root_pem else None)
        try:
            ctx.set_alpn_protocols(["h2"])
        except NotImplementedError:
            pass
        name = server_name or addr[0]
        try:
            with ctx.wrap_socket(sock, server_hostname=name) as tls:
                if tls.selected_alpn_protocol() != "h2":   # every gRPC server agrees to h2
                    return f"the server at {target} answers HTTPS, not gRPC: {_NOT_GRPC}"
        except ssl.SSLCertVerificationError as exc:
            return (f"the TLS certificate of the server at {target} did not verify "
                    f"({exc.verify_message}) with "
                    f"{'the given CA' if root_pem else 'the system CAs'} for the name {name!r}")
        return ""
    except (OSError, ValueError):   # reset, timed out, an unusable CA (the channel reports it)
        return ""
    finally:
        sock.close()
