//! The statistic: one ratio per round (the client's figure over its floor's, measured in the same
//! round), then the median and interquartile range of those ratios.

use serde::Serialize;

/// The `q`-quantile (0 to 1) of `xs` by linear interpolation between order statistics (the
/// usual "type 7": the median of an even count is the mean of the middle two).
pub fn quantile(xs: &[f64], q: f64) -> f64 {
    assert!(!xs.is_empty(), "a quantile of no values");
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let pos = q.clamp(0.0, 1.0) * (v.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    v[lo] + (v[hi] - v[lo]) * (pos - lo as f64)
}

/// Median and quartiles of a set of figures.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Spread {
    pub median: f64,
    pub q1: f64,
    pub q3: f64,
}

impl Spread {
    pub fn of(xs: &[f64]) -> Spread {
        Spread {
            median: quantile(xs, 0.5),
            q1: quantile(xs, 0.25),
            q3: quantile(xs, 0.75),
        }
    }
}

/// One row of the table: per-round figures of a client and its floor, and their paired ratio.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub path: String,
    pub floor: String,
    /// What the figures are: `us/op` (lower is better) or `gets/s` (higher is better).
    pub unit: &'static str,
    pub client: Vec<f64>,
    pub floor_figures: Vec<f64>,
    /// `client[i] / floor_figures[i]`, round by round.
    pub ratios: Vec<f64>,
    pub ratio: Spread,
    pub client_median: f64,
    pub floor_median: f64,
}

impl Row {
    pub fn new(
        path: impl Into<String>,
        floor: impl Into<String>,
        unit: &'static str,
        client: Vec<f64>,
        floor_figures: Vec<f64>,
    ) -> Row {
        assert_eq!(client.len(), floor_figures.len(), "one floor per round");
        let ratios: Vec<f64> = client
            .iter()
            .zip(&floor_figures)
            .map(|(c, f)| c / f)
            .collect();
        Row {
            path: path.into(),
            floor: floor.into(),
            unit,
            ratio: Spread::of(&ratios),
            client_median: quantile(&client, 0.5),
            floor_median: quantile(&floor_figures, 0.5),
            ratios,
            client,
            floor_figures,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn check(xs: &[f64], q: f64, expected: f64) {
        let got = quantile(xs, q);
        assert!(
            (got - expected).abs() < 1e-12,
            "quantile({xs:?}, {q}) = {got}"
        );
    }

    #[test]
    fn quantiles() {
        check(&[3.0], 0.5, 3.0);
        check(&[2.0, 1.0], 0.5, 1.5);
        check(&[5.0, 1.0, 3.0], 0.5, 3.0);
        // Nine rounds: the quartiles are the 3rd and 7th values.
        let nine = [9.0, 1.0, 8.0, 2.0, 7.0, 3.0, 6.0, 4.0, 5.0];
        check(&nine, 0.25, 3.0);
        check(&nine, 0.5, 5.0);
        check(&nine, 0.75, 7.0);
        check(&[1.0, 2.0, 3.0, 4.0], 0.25, 1.75);
        check(&[1.0, 2.0], 0.0, 1.0);
        check(&[1.0, 2.0], 1.0, 2.0);
    }

    #[test]
    fn ratios_are_paired_by_round() {
        // The floor drifts 2x between rounds; the paired ratio does not.
        let row = Row::new(
            "p",
            "f",
            "us/op",
            vec![11.0, 22.0, 33.0],
            vec![10.0, 20.0, 30.0],
        );
        assert_eq!(row.ratios.len(), 3);
        assert!(row.ratios.iter().all(|r| (r - 1.1).abs() < 1e-12));
        assert!((row.ratio.median - 1.1).abs() < 1e-12);
        assert_eq!((row.client_median, row.floor_median), (22.0, 20.0));
    }
}
