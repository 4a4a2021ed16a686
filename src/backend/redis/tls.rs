//! TLS to Redis (feature `redis-tls`): the CA and client certificate of a `rediss://` server
//! ([`RedisTls`]), checked at build, and a connection's handshake on them ([`Handshake`]): the
//! sync pool's with rustls over the socket it opened (`blocking.rs`), the async connection's
//! with tokio-rustls over its own. Also: what a refused handshake says.

use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore};

use crate::error::{Error, Result};

/// TLS settings of a `rediss://` server (feature `redis-tls`): which CA to trust and, for
/// mutual TLS, the client's certificate and key. Given to
/// [`CacheBuilder::redis_tls`](crate::CacheBuilder::redis_tls) (or
/// [`RedisConfig::tls`](super::RedisConfig::tls)).
///
/// Without a CA, the server's certificate must chain to one of the system's trusted roots
/// (the OS store); with one, to that CA alone. Either way it must be valid for the URL's host
/// (a DNS name or an IP address in its subject alternative names): `rediss://127.0.0.1:6380`
/// needs the address in the certificate, `rediss://cache.internal:6380` the name. There is no
/// way to turn verification off (redis-rs's `#insecure` is refused at build).
///
/// The PEM is checked at `build()` (a configuration error if it holds no certificate or key,
/// or the key does not match the certificate); reading it from a file is yours:
///
/// ```no_run
/// use newcache::{Cache, RedisTls};
/// let cache = Cache::builder()
///     .redis("rediss://default:secret@cache.internal:6380/0")
///     .redis_tls(RedisTls::new().ca_pem(std::fs::read("/etc/cache/ca.pem")?))
///     .build()?; // never connects
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// Its `Debug` never shows the client key.
#[derive(Clone, Default)]
pub struct RedisTls {
    ca: Option<Vec<u8>>,
    client: Option<ClientIdentity>,
}

#[derive(Clone)]
struct ClientIdentity {
    cert: Vec<u8>,
    key: Vec<u8>,
}

impl std::fmt::Debug for RedisTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ca = match &self.ca {
            Some(pem) => format!("{} bytes of PEM", pem.len()),
            None => "the system's roots".to_owned(),
        };
        f.debug_struct("RedisTls")
            .field("ca", &ca)
            .field("client_cert", &self.client.is_some())
            .finish_non_exhaustive()
    }
}

impl RedisTls {
    /// The defaults: the system's trusted roots, no client certificate.
    pub fn new() -> RedisTls {
        RedisTls::default()
    }

    /// Trusts the CA certificates in `pem` (one or more `-----BEGIN CERTIFICATE-----` blocks)
    /// instead of the system's roots: for a server whose certificate a private CA signed.
    pub fn ca_pem(mut self, pem: impl Into<Vec<u8>>) -> RedisTls {
        self.ca = Some(pem.into());
        self
    }

    /// Mutual TLS: presents the certificate chain `cert_pem` (the client's certificate first)
    /// with its private key `key_pem` (PKCS#8, PKCS#1 or SEC1 PEM), for a server that checks
    /// clients (`tls-auth-clients yes`).
    pub fn client_cert_pem(
        mut self,
        cert_pem: impl Into<Vec<u8>>,
        key_pem: impl Into<Vec<u8>>,
    ) -> RedisTls {
        self.client = Some(ClientIdentity {
            cert: cert_pem.into(),
            key: key_pem.into(),
        });
        self
    }

    /// Checks every PEM (without reading the system's roots): what `build()` refuses.
    pub(super) fn check(&self) -> Result<()> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        self.config(provider, Roots::GivenOnly).map(drop)
    }

    /// The settings as redis-rs takes them (checked first).
    pub(super) fn certificates(&self) -> redis::TlsCertificates {
        redis::TlsCertificates {
            client_tls: self.client.as_ref().map(|c| redis::ClientTlsConfig {
                client_cert: c.cert.clone(),
                client_key: c.key.clone(),
            }),
            root_cert: self.ca.clone(),
        }
    }

    /// The rustls settings of a connection, on the process's crypto provider.
    pub(super) fn client_config(&self) -> Result<Arc<ClientConfig>> {
        self.config(provider(), Roots::System).map(Arc::new)
    }

    fn config(
        &self,
        provider: Arc<rustls::crypto::CryptoProvider>,
        roots: Roots,
    ) -> Result<ClientConfig> {
        let mut store = RootCertStore::empty();
        match (&self.ca, roots) {
            (Some(pem), _) => {
                for cert in certificates(pem, "the CA (RedisTls::ca_pem)")? {
                    store.add(cert).map_err(|e| {
                        Error::config(format!(
                            "the CA (RedisTls::ca_pem) is not a certificate rustls can trust: {e}"
                        ))
                    })?;
                }
            }
            (None, Roots::System) => {
                let found = rustls_native_certs::load_native_certs();
                let (added, _) = store.add_parsable_certificates(found.certs);
                if added == 0 {
                    return Err(Error::config(format!(
                        "no CA given (RedisTls::ca_pem) and no trusted root found in the \
                         system's store{}",
                        found
                            .errors
                            .first()
                            .map(|e| format!(": {e}"))
                            .unwrap_or_default()
                    )));
                }
            }
            (None, Roots::GivenOnly) => {}
        }
        let builder = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::config(format!("rustls refused its own settings: {e}")))?
            .with_root_certificates(store);
        let Some(client) = &self.client else {
            return Ok(builder.with_no_client_auth());
        };
        let chain = certificates(
            &client.cert,
            "the client certificate (RedisTls::client_cert_pem)",
        )?;
        // The key's bytes (or a line of them) never go into a message.
        let key = PrivateKeyDer::from_pem_slice(&client.key).map_err(|_| {
            Error::config(
                "the client key (RedisTls::client_cert_pem) holds no PKCS#8, PKCS#1 or SEC1 \
                 private key in PEM",
            )
        })?;
        builder.with_client_auth_cert(chain, key).map_err(|e| {
            Error::config(format!(
                "the client certificate and key (RedisTls::client_cert_pem) cannot be used: {e}"
            ))
        })
    }
}

/// A TLS stream of the sync pool, over its socket.
pub(super) type BlockingTls = rustls::StreamOwned<rustls::ClientConnection, std::net::TcpStream>;

/// A connection's TLS: a handshake over the socket it opened, for the URL's host (the sync
/// pool's with rustls, the async view's with tokio-rustls).
#[derive(Debug)]
pub(super) struct Handshake {
    tls: RedisTls,
    name: ServerName<'static>,
}

impl Handshake {
    /// The handshake of `info`'s server, if its URL is `rediss://`.
    pub(super) fn of(
        info: &redis::ConnectionInfo,
        tls: Option<&RedisTls>,
    ) -> Result<Option<Handshake>> {
        let redis::ConnectionAddr::TcpTls { host, .. } = info.addr() else {
            return Ok(None);
        };
        Ok(Some(Handshake {
            tls: tls.cloned().unwrap_or_default(),
            name: server_name(host)?,
        }))
    }

    /// The settings of a handshake now (the system's roots read again for each connection,
    /// as redis-rs does).
    pub(super) fn config(&self) -> Result<Arc<ClientConfig>> {
        self.tls.client_config()
    }

    /// `sock` after a handshake on `config`, made now, within the socket's timeouts (a refused
    /// handshake is an error here, not on the first command): the sync pool's.
    pub(super) fn run_blocking(
        &self,
        config: Arc<ClientConfig>,
        mut sock: std::net::TcpStream,
    ) -> std::io::Result<BlockingTls> {
        let mut tls = rustls::ClientConnection::new(config, self.name.clone())
            .map_err(std::io::Error::other)?;
        while tls.is_handshaking() {
            tls.complete_io(&mut sock)?;
        }
        Ok(rustls::StreamOwned::new(tls, sock))
    }

    /// `stream` after a handshake on `config`.
    #[cfg(feature = "tokio")]
    pub(super) async fn run(
        &self,
        config: Arc<ClientConfig>,
        stream: tokio::net::TcpStream,
    ) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
        tokio_rustls::TlsConnector::from(config)
            .connect(self.name.clone(), stream)
            .await
    }
}

/// Which roots a configuration trusts when no CA is given.
#[derive(Clone, Copy)]
enum Roots {
    /// The system's (a connection's).
    System,
    /// None (a check of the PEM given).
    GivenOnly,
}

/// The certificates of `pem` (at least one), for `what`.
fn certificates(pem: &[u8], what: &str) -> Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::config(format!("{what} is not valid PEM: {e}")))?;
    if certs.is_empty() {
        return Err(Error::config(format!(
            "{what} holds no certificate (expected a -----BEGIN CERTIFICATE----- block)"
        )));
    }
    Ok(certs)
}

/// The name the server's certificate must be valid for: the URL's host.
pub(super) fn server_name(host: &str) -> Result<ServerName<'static>> {
    ServerName::try_from(host.to_owned()).map_err(|_| {
        Error::config(format!(
            "the host {host:?} of a rediss:// URL must be a DNS name or an IP address (what the \
             server's certificate is checked against)"
        ))
    })
}

/// The process's rustls crypto provider, ring's installed if none is (as redis-rs, whose TLS
/// settings ask rustls for the process default, needs it): rustls itself picks one only when
/// exactly one provider is built in (another crate of the program may bring aws-lc-rs). Every
/// connection's settings are made on it ([`RedisTls::client_config`]).
pub(super) fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    use rustls::crypto::CryptoProvider;
    if let Some(p) = CryptoProvider::get_default() {
        return p.clone();
    }
    // Another thread may win the race: its provider is then the default, and used.
    let _ = rustls::crypto::ring::default_provider().install_default();
    CryptoProvider::get_default()
        .cloned()
        .unwrap_or_else(|| Arc::new(rustls::crypto::ring::default_provider()))
}

/// What a refused TLS handshake (or a TLS error on a connection) means, if `e` is one: rustls's
/// error somewhere in its chain (redis-rs keeps it in an `Arc`, inside an I/O error).
pub(super) fn refusal(e: &(dyn std::error::Error + 'static)) -> Option<String> {
    let tls = rustls_error(e)?;
    use rustls::{AlertDescription as Alert, CertificateError as Cert, Error as Tls};
    let what = match tls {
        // A CA of the same name that did not sign it: a bad signature.
        Tls::InvalidCertificate(Cert::UnknownIssuer | Cert::BadSignature) => {
            "the server's certificate is not signed by a CA this client trusts (give the CA that \
             signed it: RedisTls::ca_pem)"
        }
        Tls::InvalidCertificate(Cert::NotValidForName | Cert::NotValidForNameContext { .. }) => {
            "the server's certificate is not valid for the URL's host"
        }
        Tls::InvalidCertificate(_) => "the server's certificate was refused",
        Tls::AlertReceived(
            Alert::CertificateRequired | Alert::HandshakeFailure | Alert::BadCertificate,
        ) => {
            "the server refused the handshake (a server that checks clients, tls-auth-clients \
             yes, needs a client certificate it trusts: RedisTls::client_cert_pem)"
        }
        Tls::InvalidMessage(_) => {
            "the server did not speak TLS (a rediss:// URL on a port without TLS?)"
        }
        _ => "the TLS handshake failed",
    };
    Some(format!("TLS: {what}: {tls}"))
}

fn rustls_error<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a rustls::Error> {
    type ArcError = Arc<dyn std::error::Error + Send + Sync>;
    let mut cur = Some(e);
    while let Some(e) = cur {
        if let Some(tls) = e.downcast_ref::<rustls::Error>() {
            return Some(tls);
        }
        if let Some(inner) = e
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
        {
            if let Some(tls) = rustls_error(inner) {
                return Some(tls);
            }
        }
        if let Some(inner) = e.downcast_ref::<ArcError>() {
            let inner: &(dyn std::error::Error + 'static) = &**inner;
            if let Some(tls) = rustls_error(inner) {
                return Some(tls);
            }
        }
        cur = e.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_malformed_pem_is_a_config_error_that_never_shows_the_key() {
        let refused = |tls: RedisTls, says: &str| {
            let e = tls.check().unwrap_err();
            assert!(e.is_config() && e.to_string().contains(says), "{e}");
            assert!(!e.to_string().contains("s3cret"), "{e}");
        };
        refused(RedisTls::new().ca_pem("not a pem"), "holds no certificate");
        refused(
            RedisTls::new().ca_pem("-----BEGIN CERTIFICATE-----\n!!!\n-----END CERTIFICATE-----\n"),
            "not valid PEM",
        );
        refused(
            RedisTls::new().client_cert_pem("nothing", "s3cret"),
            "holds no certificate",
        );
        assert!(RedisTls::new().check().is_ok());
        let tls = RedisTls::new().client_cert_pem("c", "-----BEGIN PRIVATE KEY-----\ns3cret\n");
        assert!(!format!("{tls:?}").contains("s3cret"), "{tls:?}");
    }
}
