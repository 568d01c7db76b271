//! The OpenAI API's bodies as the gateway reads and rewrites them: the
//! request body parsed once ([`body`]), the routing text of a request
//! ([`prompt`]: completions prompt forms, rendered chat messages) and the
//! answer text of a response, JSON or event stream ([`answer`]).
//!
//! | module | step |
//! | --- | --- |
//! | [`body`] | the request body parsed once: a JSON tree borrowing its strings from the body |
//! | [`prompt`] | the routing text of an OpenAI request: completions prompt forms, rendered chat messages |
//! | [`answer`] | the answer text of an OpenAI response (JSON body or event stream), read by the response processes |

pub mod answer;
pub mod body;
pub mod prompt;
