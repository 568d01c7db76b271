//! Redis URLs as semlb shows and passes them: the password a URL carries
//! found ([`url_password`]), hidden for logs ([`redacted`]) and taken out
//! for command lines ([`without_password`]).

/// `url` with its password (if any) shown as `***`, for logs.
pub fn redacted(url: &str) -> String {
    match split_password(url) {
        Some((before, after)) => format!("{before}***{after}"),
        None => url.to_owned(),
    }
}

/// `url` without its password (a user name stays), for command lines.
pub fn without_password(url: &str) -> String {
    match split_password(url) {
        Some((before, after)) => {
            let before = before.trim_end_matches(':');
            // No user name left: no `@` either.
            let after = if before.ends_with("://") { &after[1..] } else { after };
            format!("{before}{after}")
        }
        None => url.to_owned(),
    }
}

/// The password of `url`, if it has one.
pub fn url_password(url: &str) -> Option<String> {
    let (before, after) = split_password(url)?;
    let start = before.len();
    let end = url.len() - after.len();
    Some(url[start..end].to_owned())
}

/// `url` split around its password: everything up to it (ending in `:`)
/// and everything from the `@` on.
fn split_password(url: &str) -> Option<(&str, &str)> {
    let scheme_end = url.find("://")? + 3;
    let rest = &url[scheme_end..];
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let at = rest[..authority_end].rfind('@')?;
    let colon = rest[..at].find(':')?;
    Some((&url[..scheme_end + colon + 1], &url[scheme_end + at..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_found_hidden_and_taken_out() {
        let url = "rediss://app:s3cr:et@redis.internal:6380/2";
        assert_eq!(url_password(url).as_deref(), Some("s3cr:et"));
        assert_eq!(redacted(url), "rediss://app:***@redis.internal:6380/2");
        assert_eq!(without_password(url), "rediss://app@redis.internal:6380/2");
        let anonymous = "redis://:pw@127.0.0.1:6379/";
        assert_eq!(redacted(anonymous), "redis://:***@127.0.0.1:6379/");
        assert_eq!(without_password(anonymous), "redis://127.0.0.1:6379/");
        for plain in ["redis://127.0.0.1:6379/", "redis://user@host/", "redis://host/a:b@c"] {
            assert_eq!(redacted(plain), plain);
            assert_eq!(without_password(plain), plain);
            assert_eq!(url_password(plain), None);
        }
    }
}
