//! The HTML page of `GET /page/{id}`: a user and their latest orders, in a small template.

use std::fmt::Write;

use crate::db::{Order, User};

/// Renders the page. Every value from the database is escaped.
pub(crate) fn render(user: &User, orders: &[Order]) -> String {
    let name = escape(&user.name);
    let mut rows = String::new();
    for o in orders {
        let _ = writeln!(
            rows,
            "      <tr><td>{}</td><td>{}</td><td>{}.{:02}</td><td>{}</td></tr>",
            o.id,
            o.product,
            o.amount_cents / 100,
            o.amount_cents % 100,
            o.created_at
        );
    }
    format!(
        r#"<!doctype html>
<html lang="en">
  <head><meta charset="utf-8"><title>{name}</title></head>
  <body>
    <h1>{name}</h1>
    <p>{email} &middot; region {region}</p>
    <h2>Latest orders</h2>
    <table>
      <tr><th>order</th><th>product</th><th>amount</th><th>created (unix)</th></tr>
{rows}    </table>
  </body>
</html>
"#,
        email = escape(&user.email),
        region = user.region,
    )
}

fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn check(input: &str, expected: &str) {
        assert_eq!(escape(input), expected);
    }

    #[test]
    fn escapes_markup() {
        check("ann", "ann");
        check("<b>&'\"", "&lt;b&gt;&amp;&#39;&quot;");
    }

    #[test]
    fn page_shows_user_and_orders() {
        let user = User {
            id: 7,
            name: "<ann>".into(),
            email: "a@x".into(),
            region: 3,
        };
        let orders = [Order {
            id: 1,
            product: 2,
            amount_cents: 1234,
            created_at: 99,
        }];
        let html = render(&user, &orders);
        assert!(html.contains("<h1>&lt;ann&gt;</h1>"), "{html}");
        assert!(html.contains("<td>12.34</td>"), "{html}");
    }
}
